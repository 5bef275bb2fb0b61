"""Execute a reallocation plan over torch.distributed (NCCL on GPUs, gloo on CPU).

Every rank of the plan's meshes calls :func:`execute_reallocation` with the same plan and arguments.
All traffic runs on ONE process group, the ranks of src and dst (``realloc_groups``): first a
one-element all-reduce (so a batched P2P is never the group's first call, as NCCL requires,
and ranks walking different plans fail instead of hanging), then one ``batch_isend_irecv``
per *round* (``schedule_rounds``): rounds stay inside one unit and are cut by the global order
alone, so every rank's batches match. A message to k receivers is k sends in the batch (NCCL
aggregates them); no broadcast groups, no unbatched send/recv (each unbatched NCCL pair would
be a communicator of its own).

Each side of a message is in place when the piece is contiguous on that side: the sender sends
straight out of its source tensor, a receiver receives straight into its destination tensor
(no extra memory). A side that is not (a strided row-parallel slice, or small pieces packed
together) goes through a circular buffer of one bucket (``Workspace``): as many packing rounds
in flight as fit (each at most half a bucket); rounds in place are posted at once. Local copies
are made while a rank waits for its messages. Memory beyond the source: the destination shard, one bucket, and for a
ZeRO-3 source the parameters of one unit (embeddings, one layer, or the head) gathered at a
time. Every allocation goes through a meter, so the stats report the measured peak.

``share_local=True`` lets a destination tensor that a rank already holds whole (same
parameter, same slice: a pipeline stage or DP replica that keeps its layers) share the
source's storage instead of being copied: no copy and no memory. Use it for read-only copies
that are dropped or refreshed before the source changes (the runtime's copies for generation
and inference); the shared tensors change when the source does.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist

from restage.device import rank_device
from restage.errors import LayoutError
from restage.layout import ProcessGroups
from restage.runtime.dataplane.realloc_batches import Batches, Tally
from restage.runtime.store.zero_engines import Engine
from restage.schedule.realloc_plan import Piece, ReallocPlan, check_layouts, realloc_groups
from restage.schedule.realloc_rounds import Message, schedule_rounds
from restage.testing.host_tensors import same_device

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["ReallocResult", "ReallocStats", "Workspace", "execute_reallocation", "groups_for"]

DEFAULT_BUCKET_BYTES = 32 << 20
# Smaller contiguous pieces are packed: per message overhead outweighs a copy below this size.
DEFAULT_DIRECT_MIN_BYTES = 1 << 18

# A rank's source shard: parameters by canonical name, a module, or a DeepSpeed engine (None: it holds none).
Source: TypeAlias = "Mapping[str, torch.Tensor] | torch.nn.Module | Engine | None"


@dataclass(frozen=True)
class ReallocStats:
    """What one rank measured during one reallocation."""

    seconds: float
    sent_bytes_by_link: dict[tuple[int, int], int] = field(hash=False)  # counted by this rank as sender
    received_bytes_by_link: dict[tuple[int, int], int] = field(hash=False)  # counted by this rank as receiver
    local_bytes: int  # already on this rank: copied inside it, or shared (below)
    destination_shard_bytes: int
    peak_buffer_bytes: int  # largest bucket buffer held at once
    peak_gathered_bytes: int  # largest ZeRO-3 unit gathered at once (0 for other sources)
    peak_extra_bytes: int  # destination shard + buffers + gathered parameters, at their joint peak
    transfers: int  # communications this rank took part in
    shared_bytes: int = 0  # destination tensors that share the source's storage (share_local), not copied

    @property
    def sent_bytes(self) -> int:
        return sum(self.sent_bytes_by_link.values())

    @property
    def received_bytes(self) -> int:
        return sum(self.received_bytes_by_link.values())


@dataclass
class _Meter:
    """Bytes the executor holds right now and at its peak, by kind."""

    now: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    peak_total: int = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.now[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.now[kind])
        self.peak_total = max(self.peak_total, sum(self.now.values()))

    def sub(self, kind: str, nbytes: int) -> None:
        self.now[kind] -= nbytes


class Workspace:
    """A bucket buffer kept between reallocations, so its pages are not faulted in on every call.

    Hold one per rank for the run (it costs one bucket); pass it to every reallocation.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``dtype`` on ``device``, reusing the held bytes."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._buffer is None or not same_device(self._buffer.device, device) or self._buffer.numel() < nbytes:
            self._buffer = None  # free the old one first, so two buffers never coexist
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def release(self) -> None:
        self._buffer = None


@dataclass(frozen=True)
class ReallocResult:
    """The destination shard this rank now holds (empty if none) and what was measured."""

    state: dict[str, torch.Tensor]
    stats: ReallocStats


def source_state(source: Source) -> dict[str, torch.Tensor]:
    """Parameters by canonical name from a shard dict, an ``nn.Module`` or a DeepSpeed engine."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return dict(source)
    module = getattr(source, "module", source)  # a DeepSpeed engine wraps the model as ``.module``
    if isinstance(module, torch.nn.Module):
        return dict(module.named_parameters())
    raise TypeError(f"cannot read parameters from {type(source).__name__}; pass a dict, a module or an engine")


def _is_zero3(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_status")


def _zero3_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """A ZeRO-3 parameter's full shape (its own ``shape`` is that of its local partition)."""
    return tuple(tensor.ds_shape)  # type: ignore[attr-defined]  # DeepSpeed sets it on the tensor; torch's types lack it


def execute_reallocation(plan: ReallocPlan, source: Source, groups: ProcessGroups, *, dtype: torch.dtype,
                         destination: dict[str, torch.Tensor] | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         direct_min_bytes: int = DEFAULT_DIRECT_MIN_BYTES,
                         workspace: Workspace | None = None, device: torch.device | None = None,
                         share_local: bool = False) -> ReallocResult:
    """Move the parameters as ``plan`` says; call on every rank of src and dst with the same arguments.

    ``source``: this rank's shard in the source layout (dict by canonical name, module, or
    DeepSpeed engine of any ZeRO stage; None if the rank holds none). ``destination``: tensors
    to fill in place (e.g. the parameters of the destination model); allocated when None.
    A ZeRO-3 engine's partitions are gathered one unit (embeddings, a layer, the head) at a
    time; transfers always go unit by unit, so ranks agree on their order whatever their
    source is.
    ``workspace`` keeps the bucket buffer between calls (a temporary one is used otherwise).
    ``share_local``: a destination tensor this rank holds whole in the source becomes the source
    tensor (a given destination tensor is rebound to its storage) instead of a copy of it;
    never with a ZeRO-3 source, whose gathered parameters are released after use.
    Raises LayoutError before any communication if a layout does not fit the model or world.
    """
    started = time.perf_counter()
    check_layouts(plan.cfg, plan.src, plan.dst, dist.get_world_size())
    if torch.empty((), dtype=dtype).element_size() != plan.bytes_per_element:
        raise LayoutError(f"dtype {dtype} does not have the plan's {plan.bytes_per_element} bytes per element; "
                          f"plan with bytes_per_element={torch.empty((), dtype=dtype).element_size()}")
    me = dist.get_rank()
    device = device or rank_device(dist.get_backend() == "nccl")  # the device tensors travel on for the backend
    src = source_state(source) if me in plan.src else {}
    # Unit by unit on every rank, even where no source is ZeRO-3: the order must not depend on
    # anything a rank knows alone (costs a few more, smaller buckets; measured within noise).
    rounds = [r for r in schedule_rounds(plan, bucket_bytes, direct_min_bytes)
              if any(t.src_rank == me or me in t.dst_ranks for t in r.messages)]
    transfers = [t for r in rounds for t in r.messages if t.src_rank == me or me in t.dst_ranks]
    local = [p for p in plan.local_pieces if p.src_rank == me]
    group = _check_inputs(plan, me, src, transfers, local, groups, dtype)
    zero3 = any(_is_zero3(t) for t in src.values())
    needs = _units_needed_by_my_dp_group(plan, me) if zero3 else {}
    missing = sorted({n for names in needs.values() for n in names} - set(src))
    if missing:
        raise KeyError(f"rank {me}: the ZeRO-3 source has no parameters {missing[:4]}")
    if group is not None:
        _agree(plan, group, device)

    meter = _Meter()
    # share_local: a tensor this rank holds whole becomes the destination tensor (never a ZeRO-3
    # source's: its gathered parameters are released after use).
    shared = {p.name: src[p.name] for p in local if p.whole and same_device(src[p.name].device, device)} \
        if share_local and not zero3 else {}
    local = [p for p in local if p.name not in shared]
    dst = _destination(plan, me, destination, dtype, device, meter, shared)
    shard_bytes = meter.now["destination"]
    shared_bytes = sum(t.numel() * t.element_size() for t in shared.values())
    shard_bytes += shared_bytes
    bpe = plan.bytes_per_element
    # The ring holds as many packing rounds in flight as fit in one bucket (each is at most half of
    # it), but no more than this rank packs or unpacks in all (a small plan does not need a whole bucket).
    ring_numel = min(bucket_bytes // bpe, sum(r.packed_numel(me) for r in rounds))
    workspace = workspace or Workspace()
    buffer = workspace.take(ring_numel, dtype, device) if ring_numel else None
    held_bytes = workspace.nbytes  # what the workspace really holds, perhaps more than this plan needs
    meter.add("buffer", held_bytes)

    tally = Tally()
    batches = Batches(buffer, me, src, dst, group, tally)
    units = sorted({r.unit for r in rounds} | {p.unit for p in local} | set(needs))
    for unit in units:
        gather = needs.get(unit, ())
        with _gathered(src, gather, meter, bpe):
            # Local copies are made while this rank waits for its messages (see ``realloc_batches.Batches``).
            batches.local.extend(p for p in local if p.unit == unit)
            for r in rounds:
                if r.unit == unit:
                    batches.post(r)
            if gather:  # a gathered unit is released at the end of the block: finish everything reading it
                batches.drain()
    batches.drain()
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    del buffer
    meter.sub("buffer", held_bytes)
    stats = ReallocStats(
        seconds=time.perf_counter() - started, sent_bytes_by_link=dict(tally.sent), received_bytes_by_link=dict(tally.received),
        local_bytes=sum(p.numel for p in local) * bpe + shared_bytes, destination_shard_bytes=shard_bytes,
        peak_buffer_bytes=meter.peak["buffer"], peak_gathered_bytes=meter.peak["gathered"],
        peak_extra_bytes=meter.peak_total, transfers=len(transfers), shared_bytes=shared_bytes)
    return ReallocResult(dst, stats)


def _check_inputs(plan: ReallocPlan, me: int, src: dict[str, torch.Tensor], transfers: list[Message],
                  local: list[Piece], groups: ProcessGroups, dtype: torch.dtype) -> ProcessGroup | None:
    """Fail on this rank before it communicates (missing parameters, wrong shapes or dtypes, a missing group);
    return the plan's group (None for a rank outside the plan or a one-rank plan)."""
    for p in [p for t in transfers if t.src_rank == me for p in t.pieces] + local:
        tensor = src.get(p.name)
        if tensor is None:
            raise KeyError(f"rank {me}: the source has no parameter {p.name!r}; it holds {sorted(src)[:4]}...")
        shape = _zero3_shape(tensor) if _is_zero3(tensor) else tuple(tensor.shape)
        if shape != p.src_shape or tensor.dtype != dtype:
            raise ValueError(f"rank {me}: source {p.name} is {tuple(shape)} {tensor.dtype}, "
                             f"the plan expects {p.src_shape} {dtype}")
    if me not in plan.ranks or not realloc_groups(plan) or not plan.pieces:
        return None  # nothing moves between ranks (every rank copies locally): no group, no handshake
    return groups.get(plan.ranks)


def _agree(plan: ReallocPlan, group: ProcessGroup, device: torch.device) -> None:
    """The group's first call is a collective every member joins (NCCL wants it before any batched P2P);
    it also checks that every member walks the same plan, which would otherwise hang."""
    fingerprint = zlib.crc32(f"{plan.src} {plan.dst} {len(plan.pieces)} {plan.total_bytes}".encode())
    seen = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group)
    if int(seen[0]) != -int(seen[1]):
        raise RuntimeError(f"rank {dist.get_rank()}: the ranks of {plan.src} -> {plan.dst} hold different plans")


def _destination(plan: ReallocPlan, me: int, given: dict[str, torch.Tensor] | None, dtype: torch.dtype,
                 device: torch.device, meter: _Meter, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's destination tensors: the given ones or new ones; ``shared`` ones are the source's own (no memory)."""
    out = {}
    for s in plan.destination_specs(me):
        name = s.param.name
        if given is not None:
            tensor = given[name]
            if tuple(tensor.shape) != s.shape or tensor.dtype != dtype:
                raise ValueError(f"destination {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                                 f"expected {s.shape} {dtype}")
            if name in shared:
                tensor.data = shared[name].detach()  # rebinds a model's parameter to the source's storage
            out[name] = tensor.detach()
        else:
            out[name] = shared[name].detach() if name in shared else torch.empty(s.shape, dtype=dtype, device=device)
        if name not in shared:
            meter.add("destination", s.numel * plan.bytes_per_element)
    return out


def _units_needed_by_my_dp_group(plan: ReallocPlan, me: int) -> dict[int, tuple[str, ...]]:
    """Per unit, the parameters any rank of my source DP group sends or copies (the ones to gather)."""
    coord = plan.src.coord(me)
    if coord is None:
        return {}
    group = set(plan.src.group_of(me, "dp"))
    need: dict[int, set[str]] = defaultdict(set)
    for p in plan.pieces + plan.local_pieces:
        if p.src_rank in group:
            need[p.unit].add(p.name)
    return {u: tuple(sorted(names)) for u, names in need.items()}


@contextmanager
def _gathered(src: dict[str, torch.Tensor], names: tuple[str, ...], meter: _Meter, bpe: int) -> Iterator[None]:
    """Gather the ZeRO-3 partitions of ``names`` over their DP group for the duration of the block."""
    if not names:
        yield
        return
    import deepspeed

    params = [src[n] for n in names]
    nbytes = sum(math.prod(_zero3_shape(p)) for p in params) * bpe
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        meter.add("gathered", nbytes)
        try:
            yield
        finally:
            meter.sub("gathered", nbytes)


def groups_for(*plans: ReallocPlan) -> list[tuple[int, ...]]:
    """Every group the given plans broadcast on, for ``ProcessGroups`` to create collectively up front."""
    return sorted({g for plan in plans for g in realloc_groups(plan)})
