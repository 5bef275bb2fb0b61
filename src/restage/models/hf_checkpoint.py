"""HF checkpoints in and out, no conversion step.

Loading: every rank reads only the slices its shard needs (``safe_open(...).get_slice``; for
``pytorch_model.bin`` a memory-mapped ``torch.load(weights_only=True)``), so with tp*pp > 1 no
rank materialises the whole model. Saving: the TP ranks of data-parallel replica 0 gather each
parameter, and TP rank 0 of every pipeline stage writes that stage's safetensors file; stage 0
writes ``config.json`` (and the index when pp > 1). transformers loads the result unchanged. A
ZeRO-3 model's partitions are gathered one unit (embeddings, a layer, the head) at a time, never the
whole stage at once (``save_checkpoint``'s ``gathered``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.types import Device

from restage.errors import CheckpointError
from restage.layout import Layout, ProcessGroups
from restage.models.arch import LoraConfig, ModelConfig
from restage.models.decoder import StageModule
from restage.models.hf_adapter import BASE_PREFIXES, HFSource, hf_config_dict, hf_source, to_hf_tensors
from restage.models.lora import init_adapter
from restage.models.parallel import ParallelContext
from restage.models.sharding import (
    ShardSpec,
    expert_owner,
    is_adapter,
    shard_specs,
    split_range,
    stage_params,
    unit_of,
    validate_strategy,
)

# Makes a list of (ZeRO-3 partitioned) parameters whole for the block of the context it returns.
GatherUnit = Callable[[Sequence[torch.nn.Parameter]], contextlib.AbstractContextManager[object]]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json", "generation_config.json", "chat_template.jinja")


class _Slice(Protocol):
    """What ``safe_open(...).get_slice`` returns (safetensors ships its stub unannotated)."""

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class _SafeTensorsFile(Protocol):
    """The part of a ``safe_open`` handle the reader uses."""

    def keys(self) -> list[str]: ...

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str) -> _Slice: ...


class WeightReader:
    """Reads whole tensors or slices from a HF model directory, counting the bytes it fetches."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.bytes_read = 0
        # a safetensors file's handle, or a pytorch_model.bin's (memory-mapped) state dict
        self._handles: dict[str, _SafeTensorsFile | dict[str, torch.Tensor]] = {}
        files = self._weight_map()
        self._file_of = files
        self._shapes: dict[str, tuple[int, ...]] = {}

    def _weight_map(self) -> dict[str, str]:
        for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            index = self.path / index_name
            if index.is_file():
                try:
                    return dict(json.loads(index.read_text())["weight_map"])
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise CheckpointError(f"{index} is not a valid HF weight index; fix or replace it") from None
        for single in ("model.safetensors", "pytorch_model.bin"):
            if (self.path / single).is_file():
                return {key: single for key in self._open(single).keys()}
        raise CheckpointError(f"{self.path} has no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
                              f"point the model's path at a HF model directory")

    def _open(self, file: str) -> _SafeTensorsFile | dict[str, torch.Tensor]:
        if file not in self._handles:
            full = self.path / file
            try:
                if file.endswith(".safetensors"):
                    self._handles[file] = safe_open(str(full), framework="pt")
                else:
                    self._handles[file] = _torch_load(full)
            except FileNotFoundError:
                raise CheckpointError(f"{full} is named by the weight index but missing; re-download the model") from None
            except Exception as err:  # safetensors and torch raise assorted types for a corrupt file
                raise CheckpointError(f"{full} cannot be read ({type(err).__name__}: {err}); re-download or re-save it") from None
        return self._handles[file]

    def keys(self) -> set[str]:
        return set(self._file_of)

    def resolve(self, key: str) -> str | None:
        """``key`` or, for checkpoints saved without the base-model prefix, its unprefixed form."""
        if key in self._file_of:
            return key
        for prefix in BASE_PREFIXES:
            if key.startswith(prefix) and key[len(prefix):] in self._file_of:
                return key[len(prefix):]
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            handle = self._open(self._file_of[key])
            if isinstance(handle, dict):
                self._shapes[key] = tuple(handle[key].shape)
            else:
                self._shapes[key] = tuple(handle.get_slice(key).get_shape())
        return self._shapes[key]

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor ``key`` (or ``tensor[index]``), fetching only the selected elements."""
        handle = self._open(self._file_of[key])
        if isinstance(handle, dict):
            tensor = handle[key] if index is None else handle[key][index]
            tensor = tensor.clone()
        else:
            tensor = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint (from the headers; reads no data)."""
        total = 0
        for key, file in self._file_of.items():
            handle = self._open(file)
            if isinstance(handle, dict):
                total += handle[key].numel() * handle[key].element_size()
            else:
                piece = handle.get_slice(key)
                numel = 1
                for n in piece.get_shape():
                    numel *= n
                total += numel * _SAFETENSORS_ITEMSIZE[piece.get_dtype()]
        return total


def _torch_load(file: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor]
    try:  # memory-mapped, so slicing touches only the bytes it needs
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the pre-zip legacy format cannot be memory-mapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    return state


_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def load_checkpoint(module: StageModule, path: str | Path, reader: WeightReader | None = None,
                    names: AbstractSet[str] | None = None) -> WeightReader:
    """Fill ``module`` (or only its parameters in ``names``) with its shard of the HF checkpoint at ``path``;
    returns the reader (``bytes_read``)."""
    cfg, ctx = module.cfg, module.ctx
    reader = reader or WeightReader(path)
    params = dict(module.named_parameters())
    # With ep only this rank's experts are read: each rank reads its own slices, never the whole checkpoint.
    for shard in shard_specs(cfg, ctx.shard_strategy, ctx.pp_stage, ctx.tp_rank, ctx.ep_rank):
        if names is not None and shard.param.name not in names:
            continue
        name, param = shard.param.name, params[shard.param.name]
        if is_adapter(cfg, name) and name != "score.weight":
            init_adapter(param, shard)  # a HF checkpoint holds the base; adapters start fresh (or from an engine's state)
            continue
        source = hf_source(cfg, name)
        key = reader.resolve(source.key)
        if key is None and name == "score.weight":
            _init_score(param)  # a critic started from a causal LM gets a fresh scalar head
            continue
        if key is None:
            raise CheckpointError(f"{path}: tensor {source.key} is missing; is this really a {cfg.hf_architecture} checkpoint?")
        _check_full_shape(cfg, reader, key, shard, source, path)
        value = source.to_canonical(reader.read(key, source.hf_index(shard.param, shard.index())))
        with torch.no_grad():
            param.copy_(value)
    return reader


def _check_full_shape(cfg: ModelConfig, reader: WeightReader, key: str, shard: ShardSpec, source: HFSource,
                      path: str | Path) -> None:
    expected = list(shard.param.shape)
    if source.fused:
        expected[0] = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # the fused q/k/v tensor
    shape = tuple(reversed(expected)) if source.transpose else tuple(expected)
    if reader.shape(key) != shape:
        raise CheckpointError(f"{path}: tensor {key} has shape {list(reader.shape(key))}, config.json implies "
                              f"{list(shape)}; the weights do not match the config")


def _init_score(param: torch.nn.Parameter) -> None:
    # Seeded so every TP rank (the head is replicated) starts from the same values.
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(param.shape, generator=generator) / (param.shape[-1] + 1) ** 0.5
    with torch.no_grad():
        param.copy_(values)


def load_stage(path: str | Path, layout: Layout, groups: ProcessGroups | None, rank: int,
               dtype: torch.dtype = torch.float32, device: Device = None, critic: bool = False,
               lora: LoraConfig | None = None, names: AbstractSet[str] | None = None) -> StageModule:
    """Build this rank's StageModule for ``layout`` and load its shard of the checkpoint at ``path`` (only the
    parameters in ``names`` when given: ``runtime/store/sharded_frozen.py`` builds on "meta" and loads unit by unit).

    ``groups`` must hold the layout's groups (``ProcessGroups(layout.all_groups())``); it may be
    None for a one-rank layout. ``critic=True`` gives a causal LM checkpoint a scalar head; ``lora`` adds fresh
    adapters (``models/lora.py``) on a frozen base.
    """
    hf = _read_hf_config(path)
    cfg = ModelConfig.from_hf_dict(hf, source=str(path))
    if critic and not cfg.is_critic:
        cfg = cfg.as_critic()
    if lora is not None:
        cfg = replace(cfg, lora=lora)
    validate_strategy(cfg, layout.strategy, name=str(path))  # before any group is touched
    ctx = ParallelContext.from_layout(layout, groups, rank)
    module = StageModule(cfg, ctx, dtype=dtype, device=device)
    load_checkpoint(module, path, names=names)
    module.hf_config = hf  # kept so a save writes the same config keys back
    return module


def _read_hf_config(path: str | Path) -> dict[str, Any]:
    ModelConfig.from_pretrained(path)  # validates the directory and config with one-line errors
    config: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    return config


def gather_full(tensor: torch.Tensor, shard: ShardSpec, ctx: ParallelContext) -> torch.Tensor:
    """The full parameter from its TP shards (unequal widths allowed)."""
    dim = shard.param.split_dim
    if dim is None or ctx.tp_size == 1:
        return tensor
    full = shard.param.shape[dim]
    widths = [hi - lo for lo, hi in (split_range(full, ctx.tp_size, r, shard.param.unit) for r in range(ctx.tp_size))]
    moved = tensor.movedim(dim, 0)
    padded = torch.zeros((max(widths), *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: moved.shape[0]] = moved
    parts = [torch.empty_like(padded) for _ in widths]
    dist.all_gather(parts, padded, group=ctx.tp_group)
    return torch.cat([p[:w] for p, w in zip(parts, widths)], dim=0).movedim(0, dim)


def _stage_file(stage: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """One file per pipeline stage, and with ep per (stage, ep-rank): each rank writes only what it holds."""
    files = pp * ep
    return "model.safetensors" if files == 1 else f"model-{stage * ep + ep_rank + 1:05d}-of-{files:05d}.safetensors"


def save_checkpoint(module: StageModule, path: str | Path, dtype: torch.dtype | None = None,
                    hf_config: dict[str, Any] | None = None, tokenizer_from: str | Path | None = None,
                    gathered: GatherUnit | None = None) -> None:
    """Write the model as a HF directory at ``path`` (collective over data-parallel replica 0).

    Every rank of the model's layout may call it; ranks of other replicas return at once (with ep,
    the replicas of the first ep group write, each its own experts; ep-rank 0 also the rest).
    ``hf_config`` defaults to the config the module was loaded from; ``tokenizer_from`` copies
    tokenizer files from another model directory. ``gathered(params)``, for a module whose parameters are
    partitioned (ZeRO-3), makes them whole for its block: it is entered once per unit (``unit_of``: the
    embeddings, one layer, the head) and left before the next, so a rank holds at most one unit gathered; it is
    collective over the data-parallel group, so then every rank of the layout walks the units.
    """
    cfg, ctx = module.cfg, module.ctx
    writes = ctx.dp_rank < ctx.ep_size
    if not writes and gathered is None:
        return
    path = Path(path)
    dtype = dtype or module.dtype
    shards = {s.param.name: s for s in shard_specs(cfg, ctx.shard_strategy, ctx.pp_stage, ctx.tp_rank, ctx.ep_rank)}
    full = {}
    # Consecutive parameters of one unit (module order is forward order, so each unit once).
    units = itertools.groupby(module.named_parameters(), key=lambda item: unit_of(cfg, shards[item[0]].param))
    for _, members in units:
        named = list(members)
        with gathered([param for _, param in named]) if gathered is not None else contextlib.nullcontext():
            if not writes:
                continue  # in the gather only: it is collective over the data-parallel group
            for name, param in named:
                if name == "embed.weight" and not ctx.is_first_stage:
                    continue  # the last stage's copy of a tied embedding; stage 0 saves the original
                if ctx.ep_rank > 0 and shards[name].param.expert is None:
                    continue  # replicated over the ep group; ep-rank 0 saves it
                # copy: a gathered parameter's memory is reused once its unit is released
                full[name] = gather_full(param.detach(), shards[name], ctx).to(dtype=dtype, device="cpu", copy=True)
    if not writes:
        return
    if ctx.tp_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        file = _stage_file(ctx.pp_stage, ctx.pp_size, ctx.ep_rank, ctx.ep_size)
        save_file(to_hf_tensors(cfg, full), str(path / file), metadata={"format": "pt"})
        if ctx.is_first_stage and ctx.ep_rank == 0:
            _write_metadata(module, path, dtype, hf_config, tokenizer_from)
    for group, size in ((ctx.pp_group, ctx.pp_size), (ctx.tp_group, ctx.tp_size), (ctx.ep_group, ctx.ep_size)):
        if size > 1:  # nobody returns before every stage's file is on disk
            dist.barrier(group=group)


def _write_metadata(module: StageModule, path: Path, dtype: torch.dtype, hf_config: dict[str, Any] | None,
                    tokenizer_from: str | Path | None) -> None:
    cfg, pp, ep = module.cfg, module.ctx.pp_size, module.ctx.ep_size
    base = hf_config if hf_config is not None else module.hf_config
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg, dtype, base), indent=2, sort_keys=True))
    if pp * ep > 1:
        weight_map: dict[str, str] = {}
        total = 0
        itemsize = torch.empty((), dtype=dtype).element_size()
        for stage in range(pp):
            for spec in stage_params(cfg, pp, stage):
                if spec.name == "embed.weight" and stage > 0:
                    continue
                owner = 0 if spec.expert is None else expert_owner(cfg, ep, spec.expert)
                weight_map.setdefault(hf_source(cfg, spec.name).key, _stage_file(stage, pp, owner, ep))
                total += spec.numel * itemsize
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            source = Path(tokenizer_from) / name
            if source.is_file():
                shutil.copyfile(source, path / name)
