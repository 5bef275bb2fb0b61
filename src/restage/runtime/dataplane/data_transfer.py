"""Data transfer: move an MFC's output batch from the producer's DP ranks to the consumer's DP ranks.

The master knows the batch's metadata (sample ids, sequence lengths, keys, which producer DP
rank holds which samples) and hands the same :class:`BatchMeta` to every rank (over MPI).
The payloads are KB to MB, so they travel on the CPU over a :class:`Channel`: the control
plane's MPI communicator of the transfer (:class:`MpiChannel`, what the runtime uses) or a
gloo group (:class:`GlooChannel`). Never over NCCL: no communicator per (sender, receivers)
set, none created up front for every possible sender.

Planning is pure: :func:`plan_transfer` assigns the samples to consumer DP ranks, balanced by
tokens (largest first onto the lightest rank, which keeps every rank within one sample's
tokens of every other; or, for the SPMD runtime, ``assignment="contiguous"``: the global order
cut into contiguous token-balanced runs, as every MFC cuts its inputs), and picks one sender
per (producer replica, consumer replica) pair, so
each pair exchanges one message holding every key of its samples. The receivers of a
consumer DP rank are its TP ranks on the pipeline stages that need the data; a receiver that
already holds a sample (it was also a producer rank holding it) copies it locally.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from restage.data.batch import Batch
from restage.errors import LayoutError
from restage.layout import Layout
from restage.models.packing import contiguous_parts
from restage.runtime.control.channels import wait_quietly

if TYPE_CHECKING:
    from mpi4py import MPI
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class KeySpec:
    """One key of a batch: per token (``[tokens, *trailing]``) or per sequence (``[seqs, *trailing]``)."""

    name: str
    per_token: bool
    dtype: str  # torch dtype name: "int64", "float32", "bool", ...
    trailing_shape: tuple[int, ...] = ()

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype: torch.dtype = getattr(torch, self.dtype.removeprefix("torch."))
        return dtype

    def row_bytes(self) -> int:
        return math.prod(self.trailing_shape) * torch.empty((), dtype=self.torch_dtype).element_size()

    @classmethod
    def of(cls, batch: Batch) -> tuple[KeySpec, ...]:
        """The key specs of a batch (its per-token keys, then its per-sequence keys)."""
        return tuple([cls(k, True, str(v.dtype).removeprefix("torch."), tuple(v.shape[1:])) for k, v in batch.tokens.items()]
                     + [cls(k, False, str(v.dtype).removeprefix("torch."), tuple(v.shape[1:])) for k, v in batch.seqs.items()])


@dataclass(frozen=True)
class BatchMeta:
    """What every rank knows about one output batch: samples in global order and where they are.

    A sample is ``group_size`` consecutive sequences (a preference pair, a GRPO group);
    ``producer_parts[d]`` lists the global sample indices producer DP rank ``d`` holds, in the
    order its batch packs them.
    """

    sample_ids: tuple[int, ...]
    seqlens: tuple[int, ...]  # per sequence, global order
    group_size: int
    keys: tuple[KeySpec, ...]
    producer_parts: tuple[tuple[int, ...], ...]

    @property
    def n_samples(self) -> int:
        return len(self.sample_ids)

    def sample_seqlens(self, i: int) -> tuple[int, ...]:
        g = self.group_size
        return self.seqlens[i * g:(i + 1) * g]

    def sample_tokens(self, i: int) -> int:
        return sum(self.sample_seqlens(i))

    def sample_bytes(self, i: int) -> int:
        tokens, seqs = self.sample_tokens(i), self.group_size
        return sum((tokens if k.per_token else seqs) * k.row_bytes() for k in self.keys)


@dataclass(frozen=True)
class Message:
    """Every key of ``samples`` (global indices, in order) from ``src_rank`` to ``dst_ranks``."""

    src_rank: int
    dst_ranks: tuple[int, ...]
    samples: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class TransferPlan:
    """Which consumer DP rank gets which samples, and the messages that bring them there."""

    meta: BatchMeta
    producer: Layout
    consumer: Layout
    assignment: tuple[tuple[int, ...], ...]  # per consumer DP rank: global sample indices, in global order
    receivers: tuple[tuple[int, ...], ...]  # per consumer DP rank: the ranks that get its samples
    holders: tuple[tuple[int, ...], ...]  # per producer DP rank: the ranks holding its samples
    messages: tuple[Message, ...]
    bytes_by_link: dict[tuple[int, int], int] = field(hash=False)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_link.values())

    def tokens_by_consumer(self) -> list[int]:
        return [sum(self.meta.sample_tokens(i) for i in part) for part in self.assignment]


def _ranks(layout: Layout, dp: int, stages: Sequence[int] | None) -> tuple[int, ...]:
    s = layout.strategy
    pps = range(s.pp) if stages is None else sorted({p % s.pp for p in stages})
    return tuple(layout.rank_at(p, dp, t) for p in pps for t in range(s.tp))


def balance_by_tokens(tokens: Sequence[int], parts: int, prefer: Callable[[int, int], bool] = lambda i, d: False
                      ) -> list[list[int]]:
    """Sample indices of each part: largest first onto the lightest part (ties: a preferred part, then the lowest).

    The part a sample lands on was the lightest before it, so no part ends more than one
    sample's tokens above any other. Each part keeps its samples in index order.
    """
    load = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        lightest = min(load)
        d = min((d for d in range(parts) if load[d] == lightest), key=lambda d: (not prefer(i, d), d))
        out[d].append(i)
        load[d] += tokens[i]
    return [sorted(part) for part in out]


def contiguous_assignment(sample_tokens: Sequence[int], dp: int) -> list[list[int]]:
    """Global sample indices of each DP rank: contiguous, token-balanced runs; empty parts when samples < dp."""
    parts = contiguous_parts(sample_tokens, dp) if sample_tokens else []
    return parts + [[] for _ in range(dp - len(parts))]


def _assign(meta: BatchMeta, dp: int, assignment: str | Sequence[Sequence[int]] | None,
            prefer: Callable[[int, int], bool]) -> list[list[int]]:
    tokens = [meta.sample_tokens(i) for i in range(meta.n_samples)]
    if assignment is None:
        return balance_by_tokens(tokens, dp, prefer)
    if assignment == "contiguous":
        return contiguous_assignment(tokens, dp)
    if isinstance(assignment, str):
        raise LayoutError(f"unknown assignment {assignment!r}; use None, 'contiguous' or sample indices per DP rank")
    parts = [sorted(part) for part in assignment]
    if len(parts) != dp or sorted(i for part in parts for i in part) != list(range(meta.n_samples)):
        raise LayoutError(f"an explicit assignment must give each of the {meta.n_samples} samples to exactly one "
                          f"of the consumer's {dp} DP ranks")
    return parts


def _sender_pool(candidates: Sequence[int], receivers: Sequence[int], node_of: Callable[[int], int]
                 ) -> tuple[list[int], tuple[int, ...]]:
    """Ranks that may send one producer replica's samples to one consumer replica, and the receivers lacking them."""
    inside = [r for r in candidates if r in receivers]
    targets = tuple(r for r in receivers if r not in candidates)
    nodes = {node_of(r) for r in targets}
    near = [r for r in candidates if node_of(r) in nodes]
    return inside or near or list(candidates), targets


def plan_transfer(meta: BatchMeta, producer: Layout, consumer: Layout, *, consumer_stages: Sequence[int] | None = None,
                  producer_stages: Sequence[int] | None = None, node_of: Callable[[int], int] = lambda r: 0,
                  world_size: int | None = None, assignment: str | Sequence[Sequence[int]] | None = None
                  ) -> TransferPlan:
    """Plan moving a batch from ``producer``'s DP ranks to ``consumer``'s.

    ``consumer_stages``: the consumer's pipeline stages that need the data (None: all; ``(0,)``
    for inputs of the first stage only); each of its TP ranks there receives. ``producer_stages``:
    the producer's stages holding the outputs (None: all ranks of a replica, as the runtime
    broadcasts outputs over the pipeline). ``assignment``: None balances tokens (largest first
    onto the lightest rank); ``"contiguous"`` cuts the global order into contiguous
    token-balanced runs (``contiguous_assignment``, what the runtime's MFCs read); or explicit
    global sample indices per consumer DP rank. Raises LayoutError (one line) on a mismatch.
    """
    for layout in (producer, consumer):
        if world_size is not None:
            layout.check_world(world_size)
    if len(meta.producer_parts) != producer.strategy.dp:
        raise LayoutError(f"batch metadata names {len(meta.producer_parts)} producer DP ranks but {producer} has "
                          f"dp={producer.strategy.dp}; describe one part per producer DP rank")
    held = sorted(i for part in meta.producer_parts for i in part)
    if held != list(range(meta.n_samples)):
        raise LayoutError(f"producer parts must hold each of the {meta.n_samples} samples exactly once")
    holders = tuple(_ranks(producer, d, producer_stages) for d in range(producer.strategy.dp))
    receivers = tuple(_ranks(consumer, d, consumer_stages) for d in range(consumer.strategy.dp))
    owner = {i: d for d, part in enumerate(meta.producer_parts) for i in part}

    def local(i: int, d: int) -> bool:  # the consumer replica already holds sample i somewhere
        return bool(set(holders[owner[i]]) & set(receivers[d]))

    parts = _assign(meta, consumer.strategy.dp, assignment, local)
    load: dict[int, int] = defaultdict(int)
    messages: list[Message] = []
    links: defaultdict[tuple[int, int], int] = defaultdict(int)
    for d, part in enumerate(parts):
        by_producer: dict[int, list[int]] = defaultdict(list)
        for i in part:
            by_producer[owner[i]].append(i)
        for p, samples in sorted(by_producer.items()):
            pool, targets = _sender_pool(holders[p], receivers[d], node_of)
            if not targets:
                continue  # every receiver holds these samples already
            nbytes = sum(meta.sample_bytes(i) for i in samples)
            nodes = [node_of(r) for r in targets]
            sender = min(pool, key=lambda r: (-nodes.count(node_of(r)), load[r], r))
            load[sender] += nbytes * len(targets)
            messages.append(Message(sender, targets, tuple(samples), nbytes))
            for r in targets:
                links[(sender, r)] += nbytes
    return TransferPlan(meta, producer, consumer, tuple(tuple(p) for p in parts), receivers, holders,
                        tuple(sorted(messages, key=lambda m: (m.src_rank, m.dst_ranks, m.samples))), dict(links))


class Channel:
    """Moves byte tensors between global ranks: every rank posts its sends and receives in the plan's order."""

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Send each ``(tensor, dst)`` and fill each ``(tensor, src)``; returns when all are done."""
        raise NotImplementedError


class MpiChannel(Channel):
    """Over an MPI communicator whose rank ``i`` is global rank ``ranks[i]`` (mpi4py, host memory)."""

    TAG = 13

    def __init__(self, comm: MPI.Comm, ranks: Sequence[int]) -> None:
        self.comm = comm
        self.index = {r: i for i, r in enumerate(ranks)}

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]]) -> None:
        from mpi4py import MPI  # the control plane's library; only runtime processes have it

        # MPI keeps the order of messages between two ranks, so posting in the plan's order matches them.
        # Synchronous sends: a sender is done only once its receiver has matched the message. A plain Isend can
        # complete while the message still waits in the sender's queue (behind Open MPI's first TCP handshake
        # with that peer), undelivered until the sender calls MPI again: after its next gloo/NCCL step.
        requests = [self.comm.Irecv([t.numpy(), MPI.BYTE], source=self.index[r], tag=self.TAG) for t, r in receives]
        requests += [self.comm.Issend([t.numpy(), MPI.BYTE], dest=self.index[r], tag=self.TAG) for t, r in sends]
        wait_quietly(requests)  # receivers may wait long for senders still in their step


class GlooChannel(Channel):
    """Over a gloo process group (None: the default group, when it is gloo), as one batch of sends and receives."""

    def __init__(self, group: ProcessGroup | None = None) -> None:
        self.group = group

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[torch.Tensor, int]]) -> None:
        ops = [dist.P2POp(dist.irecv, t, r, self.group) for t, r in receives]
        ops += [dist.P2POp(dist.isend, t, r, self.group) for t, r in sends]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()


@dataclass(frozen=True)
class TransferResult:
    """The batch this rank received (None if it is no receiver) and the bytes it moved."""

    batch: Batch | None
    sent_bytes_by_link: dict[tuple[int, int], int] = field(hash=False)
    received_bytes_by_link: dict[tuple[int, int], int] = field(hash=False)


def _packing_order(keys: Sequence[KeySpec]) -> list[KeySpec]:
    """Keys by falling element size, so every key's bytes start aligned to its element size in a message."""
    return sorted(keys, key=lambda k: -torch.empty((), dtype=k.torch_dtype).element_size())


def _rows(meta: BatchMeta, key: KeySpec, samples: Sequence[int]) -> list[int]:
    return [meta.sample_tokens(i) if key.per_token else meta.group_size for i in samples]


def _slices(meta: BatchMeta, key: KeySpec, order: Sequence[int]) -> dict[int, tuple[int, int]]:
    """Row range of each sample inside a batch packing ``order``."""
    out, start = {}, 0
    for i, rows in zip(order, _rows(meta, key, order)):
        out[i] = (start, start + rows)
        start += rows
    return out


def _pack(meta: BatchMeta, mine: Batch, order: Sequence[int], samples: Sequence[int], device: torch.device
          ) -> torch.Tensor:
    """One byte buffer: for each key, the rows of ``samples`` in turn."""
    parts = []
    for key in _packing_order(meta.keys):
        where = _slices(meta, key, order)
        value = mine[key.name]
        parts += [value[where[i][0]:where[i][1]].contiguous().view(-1).view(torch.uint8) for i in samples]
    return torch.cat(parts).to(device) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def execute_transfer(plan: TransferPlan, mine: Batch | None, channel: Channel, rank: int) -> TransferResult:
    """Carry out ``plan`` as global rank ``rank``; every rank of the producer and consumer calls it with the same plan.

    ``mine``: the producer batch this rank holds (None if it holds none): the samples of its
    producer DP rank, in ``meta.producer_parts`` order. Returns, on each receiver, a Batch
    of its consumer DP rank's samples in global order with every key, on the CPU.
    """
    meta, me = plan.meta, rank
    my_part = next((d for d, ranks in enumerate(plan.holders) if me in ranks), None)
    order = meta.producer_parts[my_part] if my_part is not None else ()
    if my_part is not None and (0 if mine is None else mine.n_samples) != len(order):
        raise ValueError(f"rank {me} holds producer part {my_part} of {len(order)} samples but was given "
                         f"{None if mine is None else mine.n_samples}")
    sent: defaultdict[tuple[int, int], int] = defaultdict(int)
    received: defaultdict[tuple[int, int], int] = defaultdict(int)
    buffers: dict[Message, torch.Tensor] = {}
    sends: list[tuple[torch.Tensor, int]] = []
    receives: list[tuple[torch.Tensor, int]] = []
    for m in plan.messages:  # global order: both sides of every pair post in it
        if m.src_rank == me:
            assert mine is not None  # a sender holds a non-empty producer part, and its batch was checked above
            payload = _pack(meta, mine, order, m.samples, torch.device("cpu"))
            sends += [(payload, r) for r in m.dst_ranks]  # one send per receiver, from the same bytes
            for r in m.dst_ranks:
                sent[(me, r)] += m.nbytes
        elif me in m.dst_ranks:
            buffers[m] = torch.empty(m.nbytes, dtype=torch.uint8)
            receives.append((buffers[m], m.src_rank))
            received[(m.src_rank, me)] += m.nbytes
    channel.exchange(sends, receives)
    d = next((d for d, ranks in enumerate(plan.receivers) if me in ranks), None)
    batch = None if d is None else _assemble(plan, d, me, mine, order, buffers, torch.device("cpu"))
    return TransferResult(batch, dict(sent), dict(received))


def _assemble(plan: TransferPlan, d: int, me: int, mine: Batch | None, order: Sequence[int],
              buffers: Mapping[Message, torch.Tensor], device: torch.device) -> Batch:
    """This consumer DP rank's batch: its samples in global order, from local rows or received messages."""
    meta, part = plan.meta, plan.assignment[d]
    where: dict[int, tuple[Message, int]] = {}  # sample -> (message, its index in the message)
    for m, _ in buffers.items():
        if me in m.dst_ranks:
            for k, i in enumerate(m.samples):
                where[i] = (m, k)
    tokens: dict[str, torch.Tensor] = {}
    seqs: dict[str, torch.Tensor] = {}
    offsets = {m: 0 for m in buffers}
    byte_ranges: dict[tuple[Message, str], list[tuple[int, int]]] = {}
    for m in buffers:  # byte range of each (key, sample) inside each message, in packing order
        for key in _packing_order(meta.keys):
            ranges = []
            for sample_rows in _rows(meta, key, m.samples):
                ranges.append((offsets[m], offsets[m] + sample_rows * key.row_bytes()))
                offsets[m] += sample_rows * key.row_bytes()
            byte_ranges[(m, key.name)] = ranges
    for key in meta.keys:
        rows = _rows(meta, key, part)
        out = torch.empty((sum(rows), *key.trailing_shape), dtype=key.torch_dtype, device=device)
        local = _slices(meta, key, order)
        start = 0
        for i, n in zip(part, rows):
            if i in where:
                m, k = where[i]
                lo, hi = byte_ranges[(m, key.name)][k]
                out[start:start + n] = buffers[m][lo:hi].view(key.torch_dtype).view(n, *key.trailing_shape)
            else:  # this rank produced the sample itself
                assert mine is not None  # a sample no message brings is one this rank holds
                lo, hi = local[i]
                out[start:start + n] = mine[key.name][lo:hi].to(device)
            start += n
        (tokens if key.per_token else seqs)[key.name] = out
    seqlens = tuple(n for i in part for n in meta.sample_seqlens(i))
    return Batch(seqlens, tokens, seqs, meta.group_size, tuple(meta.sample_ids[i] for i in part))
