"""A frozen model held ZeRO-3 / FSDP style over its home layout's DP ranks (``models.<name>.shard_frozen``).

A *unit* is the embeddings (with GPT-2's position table), one layer, or the head (final norm and output
weight or score). ``shard_module`` flattens each unit's parameters into one buffer, pads it to a multiple of
dp and keeps this rank's contiguous 1/dp slice on the device; the parameters themselves hold no storage
between forwards. Forward pre-hooks gather a unit (``all_gather_into_tensor`` over the layout's DP group)
as it starts and drop the unit before it, and a hook at the end of the module's forward drops what is
left, so a rank holds its slices plus one gathered unit (the head of a tied-embedding model on a first
stage re-gathers the embedding: two). Every DP rank of the group runs the same units in the same order
(``runtime/execute.py`` agrees the micro-batch count over the group), as NCCL requires.

Only inference runs on such a model: it is never trained, reallocated, offloaded or saved (``check_sharded``
refuses those in one line).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from restage.errors import ConfigError
from restage.models.decoder import StageModule


@dataclass
class Unit:
    """One gathered-together group of parameters: this rank's slice of their flat, padded concatenation."""

    name: str
    params: tuple[nn.Parameter, ...]
    numels: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    shard: torch.Tensor  # [padded / dp]
    gathered: bool = False

    def gather(self, group: dist.ProcessGroup | None, dp: int) -> None:
        if self.gathered:
            return
        full = torch.empty(self.shard.numel() * dp, dtype=self.shard.dtype, device=self.shard.device)
        dist.all_gather_into_tensor(full, self.shard, group=group)
        offset = 0
        for param, numel, shape in zip(self.params, self.numels, self.shapes):
            param.data = full[offset:offset + numel].view(shape)
            offset += numel
        self.gathered = True

    def release(self) -> None:
        for param in self.params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
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


def shard_module(module: StageModule, group: dist.ProcessGroup | None, dp: int, dp_rank: int) -> ShardedFrozen:
    """Keep this rank's 1/dp slice of each unit of ``module`` (loaded whole) and hook the gathers into its forward."""
    sharded = ShardedFrozen(module, group, dp)
    plan = _units(module)
    for name, (_, params) in plan.items():
        numels = tuple(p.numel() for p in params)
        padded = -(-sum(numels) // dp) * dp
        per_rank = padded // dp
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        shard = torch.zeros(per_rank, dtype=flat.dtype, device=flat.device)
        lo = dp_rank * per_rank
        hi = min(lo + per_rank, flat.numel())
        if hi > lo:
            shard[:hi - lo].copy_(flat[lo:hi])
        del flat
        unit = Unit(name, tuple(params), numels, tuple(p.shape for p in params), shard)
        unit.release()
        sharded.units[name] = unit
    for name, (hooked, _) in plan.items():
        wanted: tuple[str, ...] = (name,)
        if name == "head" and "embed" in plan and module.tied_head:
            wanted = ("embed", "head")  # the head's output weight is the first stage's embedding
        hooked.register_forward_pre_hook(lambda _m, _args, wanted=wanted: sharded.enter(wanted))
    module.register_forward_hook(lambda _m, _args, _out: sharded.leave())
    return sharded


def _units(module: StageModule) -> dict[str, tuple[nn.Module, list[nn.Parameter]]]:
    """Each unit's name -> (the submodule whose forward starts it, its parameters), in forward order."""
    ctx = module.ctx
    units: dict[str, tuple[nn.Module, list[nn.Parameter]]] = {}
    if ctx.is_first_stage:
        embed = list(module.embed.parameters())
        if hasattr(module, "pos_embed"):
            embed += list(module.pos_embed.parameters())
        units["embed"] = (module.embed, embed)
    for index, block in module.layers.items():
        units[f"layer.{index}"] = (block, list(block.parameters()))
    if ctx.is_last_stage:
        head = list(module.final_norm.parameters())
        for name in ("score", "lm_head"):
            if hasattr(module, name):
                head += list(getattr(module, name).parameters())
        if module.tied_head and not ctx.is_first_stage:
            head += list(module.embed.parameters())  # the last stage's own copy of the tied embedding
        units["head"] = (module.final_norm, head)
    held = {id(p) for _, params in units.values() for p in params}
    missing = [name for name, p in module.named_parameters() if id(p) not in held]
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
