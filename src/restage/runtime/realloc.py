"""Execute a reallocation plan over torch.distributed (NCCL on GPUs, gloo on CPU).

Every rank of the plan's meshes calls :func:`execute_reallocation` with the same plan and arguments.
Ranks post the transfers in one global order (``schedule_transfers``) and only ever wait on
their own earlier transfers, so every pair of ranks meets its broadcasts and send/recv pairs in
the same order and nothing deadlocks. A transfer with several receivers is a broadcast on a
cached group on NCCL (create them collectively up front from :func:`groups_for`) and one send
per receiver on gloo; one receiver means send/recv.

Each side of a message is in place when the piece is contiguous on that side: the sender sends
straight out of its source tensor, a receiver receives straight into its destination tensor,
and in-place sides are all posted at once (no extra memory). A side that is not (a strided
row-parallel slice, or small pieces packed together) goes through a circular buffer of one
bucket (``Workspace``), as many messages in flight as fit. Local copies are made while a rank
waits for its messages. Memory beyond the source: the destination shard, one bucket, and for a
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
from collections import defaultdict, deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from restage.errors import LayoutError
from restage.layout import ProcessGroups
from restage.models.sharding import shard_specs
from restage.runtime.realloc_plan import (
    Piece,
    ReallocPlan,
    Transfer,
    check_layouts,
    realloc_groups,
    schedule_transfers,
)

DEFAULT_BUCKET_BYTES = 32 << 20
# A message through the ring is at most 1/SLOTS of the bucket, so at least SLOTS are in flight at once.
SLOTS = 4
# Smaller contiguous pieces are packed: per message overhead outweighs a copy below this size.
DEFAULT_DIRECT_MIN_BYTES = 1 << 18


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
        if self._buffer is None or self._buffer.device != device or self._buffer.numel() < nbytes:
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


def source_state(source) -> dict[str, torch.Tensor]:
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


def _view(tensor: torch.Tensor, dim: int, rng: tuple[int, int]) -> torch.Tensor:
    return tensor.detach().narrow(dim, rng[0], rng[1] - rng[0])


def default_device() -> torch.device:
    """The device tensors travel on for the default group's backend."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def execute_reallocation(plan: ReallocPlan, source, groups: ProcessGroups, *, dtype: torch.dtype,
                         destination: dict[str, torch.Tensor] | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                         direct_min_bytes: int = DEFAULT_DIRECT_MIN_BYTES, layer_by_layer: bool | None = None,
                         workspace: Workspace | None = None, device: torch.device | None = None,
                         share_local: bool = False) -> ReallocResult:
    """Move the parameters as ``plan`` says; call on every rank of src and dst with the same arguments.

    ``source``: this rank's shard in the source layout (dict by canonical name, module, or
    DeepSpeed engine of any ZeRO stage; None if the rank holds none). ``destination``: tensors
    to fill in place (e.g. the parameters of the destination model); allocated when None.
    A ZeRO-3 engine's partitions are gathered one unit (embeddings, a layer, the head) at a
    time; transfers always go unit by unit, so ranks agree on their order whatever their
    source is (``layer_by_layer`` is accepted for older callers and ignored).
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
    device = device or default_device()
    src = source_state(source) if me in plan.src else {}
    # Unit by unit on every rank, even where no source is ZeRO-3: the order must not depend on
    # anything a rank knows alone (costs a few more, smaller buckets; measured within noise).
    transfers = [t for t in schedule_transfers(plan, bucket_bytes // SLOTS, direct_min_bytes, by_unit=True)
                 if t.src_rank == me or me in t.dst_ranks]
    local = [p for p in plan.local_pieces if p.src_rank == me]
    _check_inputs(plan, me, src, transfers, local, groups, dtype)
    zero3 = any(_is_zero3(t) for t in src.values())
    needs = _units_needed_by_my_dp_group(plan, me) if zero3 else {}
    missing = sorted({n for names in needs.values() for n in names} - set(src))
    if missing:
        raise KeyError(f"rank {me}: the ZeRO-3 source has no parameters {missing[:4]}")

    meter = _Meter()
    # share_local: a tensor this rank holds whole becomes the destination tensor (never a ZeRO-3
    # source's: its gathered parameters are released after use).
    shared = {p.name: src[p.name] for p in local if p.whole and src[p.name].device == device} \
        if share_local and not zero3 else {}
    local = [p for p in local if p.name not in shared]
    dst = _destination(plan, me, destination, dtype, device, meter, shared)
    shard_bytes = meter.now["destination"]
    shared_bytes = sum(t.numel() * t.element_size() for t in shared.values())
    shard_bytes += shared_bytes
    bpe = plan.bytes_per_element
    # The ring holds as many messages in flight as fit in one bucket, but no more than this rank
    # packs or unpacks in all (a small plan does not need a whole bucket).
    ring_numel = min(bucket_bytes // bpe, sum(t.numel for t in transfers if not t.in_place_for(me)))
    workspace = workspace or Workspace()
    buffer = workspace.take(ring_numel, dtype, device) if ring_numel else None
    held_bytes = workspace.nbytes  # what the workspace really holds, perhaps more than this plan needs
    meter.add("buffer", held_bytes)

    tally = _Tally()
    ring = _Ring(buffer, me, src, dst, groups, tally, fan_out=dist.get_backend() != "nccl")
    stages = sorted({t.stage for t in transfers} | {p.unit for p in local} | set(needs))
    for stage in stages:
        mine = [t for t in transfers if t.stage == stage]
        gather = needs.get(stage, ())
        with _gathered(src, gather, meter, bpe):
            # Local copies are made while this rank waits for its messages (see _Ring).
            ring.local.extend(p for p in local if p.unit == stage)
            # Post in the global order. A side in place needs no buffer and is posted at once;
            # a side that packs or unpacks takes room in the ring, many messages in flight.
            for t in mine:
                ring.post(t)
            if gather:  # a gathered unit is released at the end of the block: finish everything reading it
                ring.drain()
    ring.drain()
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


def _check_inputs(plan: ReallocPlan, me: int, src: dict, transfers: list[Transfer], local: list[Piece],
                  groups: ProcessGroups, dtype: torch.dtype) -> None:
    """Fail on this rank before it communicates: missing parameters, wrong shapes or dtypes, missing groups."""
    for p in [p for t in transfers if t.src_rank == me for p in t.pieces] + local:
        tensor = src.get(p.name)
        if tensor is None:
            raise KeyError(f"rank {me}: the source has no parameter {p.name!r}; it holds {sorted(src)[:4]}...")
        shape = tuple(tensor.ds_shape) if _is_zero3(tensor) else tuple(tensor.shape)
        if shape != p.src_shape or tensor.dtype != dtype:
            raise ValueError(f"rank {me}: source {p.name} is {tuple(shape)} {tensor.dtype}, "
                             f"the plan expects {p.src_shape} {dtype}")
    for t in transfers:
        if len(t.dst_ranks) > 1:
            groups.get(t.group)


def _destination(plan: ReallocPlan, me: int, given: dict[str, torch.Tensor] | None, dtype: torch.dtype,
                 device: torch.device, meter: _Meter, shared: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's destination tensors: the given ones or new ones; ``shared`` ones are the source's own (no memory)."""
    coord = plan.dst.coord(me)
    if coord is None:
        return {}
    specs = shard_specs(plan.cfg, plan.dst.strategy, coord.pp, coord.tp)
    out = {}
    for s in specs:
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
    nbytes = sum(math.prod(p.ds_shape) for p in params) * bpe
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        meter.add("gathered", nbytes)
        try:
            yield
        finally:
            meter.sub("gathered", nbytes)


@dataclass
class _Tally:
    """Bytes of the buffers this rank really handed to torch.distributed, per (sender, receiver) link."""

    sent: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    received: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))


class _FanOut:
    """The sends of one message to each receiver, waited on as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


def _communicate(payload: torch.Tensor, t: Transfer, me: int, groups: ProcessGroups, tally: _Tally, fan_out: bool):
    """Start a broadcast on the transfer's group, or send/recv for one receiver; count the bytes.

    ``fan_out`` (gloo): several receivers get one send each instead of a broadcast. Gloo runs an
    asynchronous broadcast on the group's worker thread at about 0.6 ms a call (measured: 256
    broadcasts of 192 KiB to 3 ranks take 3.4x as long as one of 48 MiB), while sends and
    receives cost next to nothing per message; the bytes on each link are the same.
    """
    nbytes = payload.numel() * payload.element_size()
    if t.src_rank == me:
        for r in t.dst_ranks:
            tally.sent[(me, r)] += nbytes
    else:
        tally.received[(t.src_rank, me)] += nbytes
    if len(t.dst_ranks) > 1 and not fan_out:
        return dist.broadcast(payload, src=t.src_rank, group=groups.get(t.group), async_op=True)
    if t.src_rank != me:
        return dist.irecv(payload, src=t.src_rank)
    if len(t.dst_ranks) == 1:
        return dist.isend(payload, dst=t.dst_ranks[0])
    return _FanOut([dist.isend(payload, dst=r) for r in t.dst_ranks])


class _Ring:
    """Posts transfers; the sides that pack or unpack take room in one circular buffer.

    A side in place (the piece's own memory, contiguous) is posted at once and needs no room.
    A packed side takes the next ``numel`` elements of the buffer, after waiting for the oldest
    messages there to finish if it is full, so every message that fits is in flight at once
    and together they never exceed the buffer. While it waits, the rank makes its local copies.
    Ranks post in the schedule's global order and wait only on their own earlier transfers, so
    the oldest unfinished transfer always has every participant posted: no deadlock.
    """

    def __init__(self, buffer: torch.Tensor | None, me: int, src: dict, dst: dict, groups: ProcessGroups,
                 tally: _Tally, fan_out: bool):
        self.buffer = buffer
        self.live: deque[tuple[int, int, object, Transfer, torch.Tensor]] = deque()  # (start, stop, work, t, payload)
        self.in_place: list = []
        self.local: deque[Piece] = deque()  # local copies still to make
        self.me, self.src, self.dst, self.groups, self.tally, self.fan_out = me, src, dst, groups, tally, fan_out

    def post(self, t: Transfer) -> None:
        sender = t.src_rank == self.me
        if t.in_place_for(self.me):
            (p,) = t.pieces
            payload = _view(self.src[p.name], p.dim, p.src_range) if sender else _view(self.dst[p.name], p.dim, p.dst_range)
            self.in_place.append(_communicate(payload, t, self.me, self.groups, self.tally, self.fan_out))
            return
        start = self._room(t.numel)
        payload = self.buffer[start: start + t.numel]
        if sender:
            offset = 0
            for p in t.pieces:
                payload[offset: offset + p.numel].view(p.block_shape).copy_(_view(self.src[p.name], p.dim, p.src_range))
                offset += p.numel
        work = _communicate(payload, t, self.me, self.groups, self.tally, self.fan_out)
        self.live.append((start, start + t.numel, work, t, payload))

    def _room(self, numel: int) -> int:
        """Where ``numel`` elements fit after the newest live message (wrapping around), finishing the oldest until they do."""
        size = self.buffer.numel()
        while self.live:
            head, tail = self.live[-1][1], self.live[0][0]
            if head > tail:  # not wrapped: room after the head, or at the start before the tail
                if head + numel <= size:
                    return head
                if numel <= tail:
                    return 0
            elif head + numel <= tail:
                return head
            self._finish_oldest()
        return 0

    def _finish_oldest(self) -> None:
        _, _, work, t, payload = self.live[0]
        while self.local and not work.is_completed():
            self._copy_one_local()
        work.wait()
        self.live.popleft()
        if t.src_rank != self.me:
            offset = 0
            for p in t.pieces:
                _view(self.dst[p.name], p.dim, p.dst_range).copy_(payload[offset: offset + p.numel].view(p.block_shape))
                offset += p.numel

    def _copy_one_local(self) -> None:
        p = self.local.popleft()
        _view(self.dst[p.name], p.dim, p.dst_range).copy_(_view(self.src[p.name], p.dim, p.src_range))

    def drain(self) -> None:
        """Make the remaining local copies and finish every posted transfer (unpacking what arrived)."""
        while self.local:
            self._copy_one_local()
        while self.live:
            self._finish_oldest()
        for work in self.in_place:
            work.wait()
        self.in_place = []


def groups_for(*plans: ReallocPlan) -> list[tuple[int, ...]]:
    """Every group the given plans broadcast on, for ``ProcessGroups`` to create collectively up front."""
    return sorted({g for plan in plans for g in realloc_groups(plan)})
