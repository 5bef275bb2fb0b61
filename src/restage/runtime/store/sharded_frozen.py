"""A frozen model held ZeRO-3 / FSDP style over its home layout's DP ranks (``models.<name>.shard_frozen``).

A *unit* is the embeddings (with GPT-2's position table), one layer, or the head (final norm and output
weight or score). ``load_sharded`` reads the checkpoint one unit at a time; ``shard_module`` flattens each
unit's parameters into one buffer, pads it to a multiple of dp and keeps this rank's contiguous 1/dp slice
on the device; the parameters themselves hold no storage between forwards. Forward pre-hooks gather a
unit (``all_gather_into_tensor`` over the layout's DP group) as it starts and drop the unit before it,
and a hook at the end of the module's forward drops what is left, so a rank holds its slices plus one
gathered unit (the head of a tied-embedding model on a first stage re-gathers the embedding: two).
Every DP rank of the group runs the same units in the same order (``runtime/step/execute.py`` agrees the
micro-batch count over the group), as NCCL requires.

Only inference runs on such a model: it is never trained, reallocated, offloaded or saved (``check_sharded``
refuses those in one line).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from restage.errors import ConfigError
from restage.layout import Layout, ProcessGroups
from restage.models.decoder import StageModule
from restage.models.hf_checkpoint import WeightReader, load_checkpoint, load_stage


@dataclass
class Unit:
    """One gathered-together group of parameters: this rank's slice of their flat, padded concatenation."""

    name: str
    owners: tuple[tuple[nn.Module, str], ...]  # (submodule, attribute) of each parameter
    shapes: tuple[torch.Size, ...]
    shard: torch.Tensor  # [padded / dp]
    gathered: bool = False

    def gather(self, group: dist.ProcessGroup | None, dp: int) -> None:
        if self.gathered:
            return
        full = torch.empty(self.shard.numel() * dp, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_into_tensor(full, self.shard, group=group)
        offset = 0
        for (owner, attr), shape in zip(self.owners, self.shapes):
            numel = shape.numel()
            setattr(owner, attr, nn.Parameter(full[offset:offset + numel].view(shape), requires_grad=False))
            offset += numel
        self.gathered = True

    def release(self) -> None:
        for owner, attr in self.owners:
            setattr(owner, attr, nn.Parameter(self.shard.new_empty(0), requires_grad=False))
        self.gathered = False


@dataclass
class ShardedFrozen:
    """The units of one rank's sharded frozen module and the DP group they are gathered over."""

    module: StageModule
    group: dist.ProcessGroup | None
    dp: int
    units: dict[str, Unit] = field(default_factory=dict)
    current: tuple[str, ...] = ()  # the units gathered now

    def shard_bytes(self) -> int:
        return sum(u.shard.numel() * u.shard.element_size() for u in self.units.values())

    def enter(self, names: tuple[str, ...]) -> None:
        """Drop the units gathered for the previous part of the forward, gather ``names``."""
        for name in self.current:
            if name not in names:
                self.units[name].release()
        for name in names:
            self.units[name].gather(self.group, self.dp)
        self.current = names

    def leave(self) -> None:
        self.enter(())


def load_sharded(path: str, layout: Layout, groups: ProcessGroups, rank: int, dtype: torch.dtype, device: torch.device,
                 critic: bool) -> tuple[StageModule, ShardedFrozen]:
    """This rank's stage of the checkpoint at ``path`` in ``layout``, held 1/dp (``shard_module``); read unit by unit,
    so loading never holds more than one unit whole either."""
    module = load_stage(path, layout, groups, rank, dtype, torch.device("meta"), critic=critic, names=frozenset())
    module.requires_grad_(False)
    module.eval()
    ctx = module.ctx
    reader = WeightReader(path)
    sharded = shard_module(module, ctx.dp_group, layout.strategy.dp, ctx.coord.dp,
                           lambda names: load_checkpoint(module, path, reader, names), device)
    return module, sharded


def shard_module(module: StageModule, group: dist.ProcessGroup | None, dp: int, dp_rank: int,
                 fill: Callable[[AbstractSet[str]], object], device: torch.device) -> ShardedFrozen:
    """Keep this rank's 1/dp slice of each unit of ``module`` (built on "meta") on ``device`` and hook the gathers
    into its forward: each unit is materialised on ``device``, filled (``fill(names)`` loads the named
    parameters), sliced and dropped before the next."""
    sharded = ShardedFrozen(module, group, dp)
    plan = _units(module)
    qualified = {(id(owner), attr): f"{prefix}.{attr}" if prefix else attr for prefix, owner in module.named_modules()
                 for attr, _ in owner.named_parameters(recurse=False)}
    for name, (_, owners) in plan.items():
        for owner, attr in owners:
            meta = getattr(owner, attr)
            setattr(owner, attr, nn.Parameter(torch.empty(meta.shape, dtype=meta.dtype, device=device),
                                              requires_grad=False))
        fill({qualified[(id(owner), attr)] for owner, attr in owners})
        params = [getattr(owner, attr) for owner, attr in owners]
        numel = sum(p.numel() for p in params)
        per_rank = -(-numel // dp)
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        shard = torch.zeros(per_rank, dtype=flat.dtype, device=flat.device)
        lo, hi = dp_rank * per_rank, min((dp_rank + 1) * per_rank, numel)
        if hi > lo:
            shard[:hi - lo].copy_(flat[lo:hi])
        del flat, params
        unit = Unit(name, tuple(owners), tuple(getattr(o, a).shape for o, a in owners), shard)
        unit.release()
        sharded.units[name] = unit
    for name, (hooked, _) in plan.items():
        wanted: tuple[str, ...] = (name,)
        if name == "head" and "embed" in plan and module.tied_head:
            wanted = ("embed", "head")  # the head's output weight is the first stage's embedding
        hooked.register_forward_pre_hook(lambda _m, _args, wanted=wanted: sharded.enter(wanted))
    module.register_forward_hook(lambda _m, _args, _out: sharded.leave())
    return sharded


def _units(module: StageModule) -> dict[str, tuple[nn.Module, list[tuple[nn.Module, str]]]]:
    """Each unit's name -> (the submodule whose forward starts it, (submodule, attribute) of its parameters), in
    forward order."""
    ctx = module.ctx
    parts: dict[str, tuple[nn.Module, list[nn.Module]]] = {}
    if ctx.is_first_stage:
        parts["embed"] = (module.embed, [module.embed, *([module.pos_embed] if hasattr(module, "pos_embed") else [])])
    for index, block in module.layers.items():
        parts[f"layer.{index}"] = (block, [block])
    if ctx.is_last_stage:
        head = [module.final_norm, *(getattr(module, n) for n in ("score", "lm_head") if hasattr(module, n))]
        if module.tied_head and not ctx.is_first_stage:
            head.append(module.embed)  # the last stage's own copy of the tied embedding
        parts["head"] = (module.final_norm, head)
    units = {name: (hooked, [(owner, attr) for sub in subs for owner in sub.modules()
                             for attr, _ in owner.named_parameters(recurse=False)])
             for name, (hooked, subs) in parts.items()}
    held = {id(getattr(owner, attr)) for _, owners in units.values() for owner, attr in owners}
    missing = [name for name, param in module.named_parameters() if id(param) not in held]
    assert not missing, f"parameters outside every unit: {missing}"
    return units


def check_sharded(name: str, trainable: bool, offload_when_idle: bool, lora: bool, ep: int, moved: bool) -> None:
    """Refuse, in one line, what a sharded frozen model cannot do."""
    why = ("it is trained" if trainable else "it is offloaded when idle (models.{0}.offload_when_idle)"
           if offload_when_idle else "it has LoRA adapters" if lora else "its layout has ep > 1" if ep > 1
           else "one of its MFCs runs on a layout other than its home (a reallocated copy)" if moved else "")
    if why:
        raise ConfigError(f"models.{name}.shard_frozen: a sharded frozen model runs only inference on its home "
                          f"layout, but {why.format(name)}; set models.{name}.shard_frozen false")
