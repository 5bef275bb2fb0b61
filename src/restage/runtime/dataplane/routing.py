"""Which samples each data-parallel rank of an MFC works on, and moving MFC outputs to consumers.

Samples keep the master's order everywhere ("global order"). An MFC with data-parallel degree
``dp`` cuts the global order into ``dp`` contiguous parts of near-equal tokens
(``contiguous_parts``), so concatenating its outputs over DP ranks gives the global order back.
A consumer re-cuts by its own ``dp`` and pulls each of its samples from the producer replica
holding it.

Metadata (sample ids, sequence lengths, key dtypes) goes over MPI, on a sub-communicator of
the ranks taking part in the transfer; from it every rank builds the same
``transfer.BatchMeta`` and plan (``assignment="contiguous"``, senders chosen on the
receivers' node by ``node_of``), and ``transfer.execute_transfer`` moves the tensors (KB to
MB) over the same MPI sub-communicator: no torch.distributed group, no NCCL communicator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, assert_never

from restage.data.batch import Batch
from restage.data.datasets import Dataset
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.flops import attended_tokens, forward_flops
from restage.runtime.control.channels import allgather, bcast
from restage.runtime.dataplane.data_transfer import (
    BatchMeta,
    KeySpec,
    MpiChannel,
    TransferPlan,
    contiguous_assignment,
    execute_transfer,
    plan_transfer,
)
from restage.schedule.ops import Ema, Free, Generate, Offload, Op, Push, Realloc, Reload, Run, SendKey, TakeBuffered

if TYPE_CHECKING:  # importing mpi4py initializes MPI: only create_comms, which talks over it, imports it
    from mpi4py import MPI

# How a consumer cuts the global order (transfer.plan_transfer's ``assignment``): "contiguous", or the global
# sample indices of each consumer DP rank.
Assignment = str | list[list[int]]


@dataclass(frozen=True)
class OutputMeta:
    """The global picture of one MFC's output batch."""

    ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    group_size: int
    keys: tuple[KeySpec, ...]
    parts: tuple[tuple[int, ...], ...]  # global sample indices each producer DP rank holds

    def key(self, name: str) -> KeySpec:
        return next(k for k in self.keys if k.name == name)


@dataclass(frozen=True)
class OutputPart:
    """What one producer DP rank tells the ranks of a transfer about its part of the output (sent over MPI)."""

    dp_rank: int
    ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    group_size: int
    keys: tuple[KeySpec, ...]


class SampleRouter:
    """Per-step sample assignment and output transfer for one rank."""

    def __init__(self, graph: DataflowGraph, layouts: dict[str, Layout], rank: int,
                 node_of: Callable[[int], int] = lambda r: 0):
        self.graph, self.layouts, self.rank, self.node_of = graph, layouts, rank, node_of
        self._comms: dict[tuple[int, ...], MPI.Comm] = {}
        self.meta: dict[tuple[str, tuple[int, ...]], OutputMeta] = {}
        self._dataset_tokens: list[int] = []
        self.ids: list[int] = []

    # -- start-up -------------------------------------------------------------------------------------
    def create_comms(self, ops: list[Op], comm: MPI.Comm) -> None:
        """MPI sub-communicators for the metadata and payloads of each transfer, split from ``comm`` in op order.

        ``Split`` is collective over all of ``comm`` (a rank outside a transfer passes MPI_UNDEFINED), once per
        distinct rank set, at start-up. Not ``Create_group``: Open MPI 5 gives such communicators extended ids
        agreed through a PMIx group operation, which under srun goes through Slurm's PMIx server; ``Split``
        agrees on ids among the ranks themselves.
        """
        from mpi4py import MPI  # the control plane's library; only runtime processes have it

        split: set[tuple[int, ...]] = set()
        for op in ops:
            match op:
                case SendKey():
                    pass
                case Run() | Realloc() | Free() | Offload() | Reload() | Ema() | Push() | Generate() | TakeBuffered():
                    # no MPI communicator of their own
                    continue
                case _:
                    assert_never(op)
            if op.ranks in split:
                continue
            split.add(op.ranks)
            member = self.rank in op.ranks
            sub = comm.Split(0 if member else MPI.UNDEFINED, op.ranks.index(self.rank) if member else 0)
            if member:
                self._comms[op.ranks] = sub

    # -- per step ---------------------------------------------------------------------------------------
    def begin_step(self, ids: list[int], dataset: Dataset) -> None:
        self.ids = list(ids)
        self.meta = {}
        self._dataset_tokens = dataset.batch(self.ids).sample_tokens() if self.ids else []

    def dataset_positions(self, mfc: MFC, dp_rank: int) -> list[int]:
        """Dataset positions of the samples a DP rank of ``mfc`` reads from the data set."""
        parts = contiguous_assignment(self._dataset_tokens, self.layouts[mfc.name].strategy.dp)
        return [self.ids[i] for i in parts[dp_rank]]

    def positions_of(self, ids: list[int], dataset: Dataset, mfc: MFC, dp_rank: int) -> list[int]:
        """``dataset_positions`` for another step's ``ids`` (async mode's generation ahead), this step untouched."""
        parts = contiguous_assignment(dataset.batch(list(ids)).sample_tokens(), self.layouts[mfc.name].strategy.dp)
        return [ids[i] for i in parts[dp_rank]]

    def _gather_meta(self, op: SendKey, mine: Batch | None) -> OutputMeta:
        # Cached per (producer, op ranks): every member of one transfer communicator must take
        # part in its allgather, even a rank that learnt the producer's layout in an earlier op.
        # Gathered again when the cached picture lacks the key: a generate MFC's function rewards join its
        # output after its first transfers (they score in the background; runtime/step/op_handlers.py). Every member
        # holds the same cached picture, so all of them gather again together.
        cache_key = (op.producer, op.ranks)
        cached = self.meta.get(cache_key)
        if cached is not None and any(k.name == op.key for k in cached.keys):
            return cached
        producer_layout = self.layouts[op.producer]
        coord = producer_layout.coord(self.rank)
        contribution: OutputPart | None = None
        if coord is not None and coord.tp == 0 and coord.pp == 0 and mine is not None:
            contribution = OutputPart(coord.dp, mine.ids, mine.seqlens, mine.group_size, KeySpec.of(mine))
        gathered: list[OutputPart] = [c for c in allgather(self._comms[op.ranks], contribution) if c is not None]
        gathered.sort(key=lambda c: c.dp_rank)
        group = gathered[0].group_size if gathered else 1
        parts: list[tuple[int, ...]] = [() for _ in range(producer_layout.strategy.dp)]
        start = 0
        for c in gathered:
            count = len(c.seqlens) // group
            parts[c.dp_rank] = tuple(range(start, start + count))
            start += count
        meta = OutputMeta(tuple(i for c in gathered for i in c.ids), tuple(n for c in gathered for n in c.seqlens),
                          group, gathered[0].keys if gathered else (), tuple(tuple(p) for p in parts))
        self.meta[cache_key] = meta
        return meta

    def _assignment(self, op: SendKey) -> Assignment:
        """How the consumer cuts the global order: as the output holding its first input (its token ids) is cut.

        Keys from another producer (ReMax's greedy baseline rewards) come with that producer's
        sequence lengths, so a token-balanced cut of them could differ: they follow the first
        input's cut, which the consumer's first rank knows and tells every member of this transfer.
        """
        primary = self.graph.producer(self.graph[op.mfc].inputs[0])
        if primary is None or primary.name == op.producer:
            return "contiguous"
        root = op.dst.mesh[0]
        parts: list[list[int]] | None = None
        if self.rank == root:
            first = next(m for (producer, _), m in self.meta.items() if producer == primary.name)
            g = first.group_size
            tokens = [sum(first.seqlens[i:i + g]) for i in range(0, len(first.seqlens), g)]
            parts = contiguous_assignment(tokens, op.dst.strategy.dp)
        assignment: list[list[int]] = bcast(self._comms[op.ranks], parts, root=op.ranks.index(root))
        return assignment

    def plan(self, op: SendKey, meta: OutputMeta, assignment: Assignment) -> TransferPlan:
        """The plan of one transfer op (one key), senders chosen on the receivers' node (the run's ``node_of``)."""
        n_samples = len(meta.seqlens) // meta.group_size
        batch = BatchMeta(meta.ids or tuple(range(n_samples)), meta.seqlens, meta.group_size, (meta.key(op.key),),
                          meta.parts)
        return plan_transfer(batch, op.src, op.dst, assignment=assignment, node_of=self.node_of)

    def execute(self, op: SendKey, mine: Batch | None) -> tuple[Batch | None, int]:
        """Move ``op.key`` of the producer's output to the consumer's DP ranks; returns (received, bytes sent)."""
        meta = self._gather_meta(op, mine)
        if op.ranks == (self.rank,) and op.src == op.dst:
            # Producer and consumer are this one rank: the output already is the input, nothing to cut or copy.
            return (_on_cpu(mine.only((op.key,)), mine.ids) if mine is not None and mine.n_samples else None), 0
        # The consumer cuts the global order as its dataset-loaded keys are cut, so the two line up.
        plan = self.plan(op, meta, self._assignment(op))
        result = execute_transfer(plan, mine, MpiChannel(self._comms[op.ranks], op.ranks), self.rank)
        sent = sum(result.sent_bytes_by_link.values())
        batch = result.batch
        if batch is None or not batch.n_samples:
            return None, sent
        return _on_cpu(batch, batch.ids if meta.ids else ()), sent


def _on_cpu(batch: Batch, ids: tuple[int, ...]) -> Batch:
    return Batch(batch.seqlens, {k: v.cpu() for k, v in batch.tokens.items()}, {k: v.cpu() for k, v in batch.seqs.items()},
                 batch.group_size, ids)


def measured_flops(mfc: MFC, cfg: ModelConfig, batch: Batch | None, tokens: int) -> float:
    """Model FLOPs of what an MFC actually processed on one DP replica (3 forwards per trained token)."""
    if not tokens:
        return 0.0
    mean_len = tokens / max(1, batch.n_seqs if batch is not None else 1)
    flops = forward_flops(cfg, tokens, attended_tokens(int(mean_len), None))
    return 3 * flops if mfc.kind is MFCKind.TRAIN_STEP else flops
