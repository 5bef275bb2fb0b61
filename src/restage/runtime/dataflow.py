"""Which samples each data-parallel rank of an MFC works on, and moving MFC outputs to consumers.

Samples keep the master's order everywhere ("global order"). An MFC with data-parallel degree
``dp`` cuts the global order into ``dp`` contiguous parts of near-equal tokens
(``contiguous_parts``), so concatenating its outputs over DP ranks gives the global order back.
A consumer re-cuts by its own ``dp`` and pulls each of its samples from the producer replica
holding it.

Metadata (sample ids, sequence lengths, key dtypes) goes over MPI, on a sub-communicator of
the ranks taking part in the transfer; tensors go over torch.distributed: for every
(producer replica, consumer replica) pair that shares samples, one sender broadcasts the
packed rows to the consumer replica's ranks. A sender inside the consumer replica skips the
copy to itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from restage.data.batch import Batch, contiguous_parts
from restage.graph import MFC, DataflowGraph
from restage.layout import Layout, ProcessGroups
from restage.models.config import ModelConfig
from restage.plan.compute import attended_tokens
from restage.plan.flops import forward_flops


@dataclass(frozen=True)
class OutputMeta:
    """The global picture of one MFC's output batch."""

    ids: tuple
    seqlens: tuple[int, ...]
    group_size: int
    keys: dict  # key -> ("tokens" | "seqs", dtype name, trailing shape)
    parts: tuple[tuple[int, ...], ...]  # global sample indices each producer DP rank holds

    def sample_tokens(self) -> list[int]:
        g = self.group_size
        return [sum(self.seqlens[i * g:(i + 1) * g]) for i in range(len(self.seqlens) // g)]


def replicas(layout: Layout) -> list[tuple[int, ...]]:
    """The ranks of each data-parallel replica (all its tp x pp ranks), by DP index."""
    s = layout.strategy
    return [tuple(layout.rank_at(p, d, t) for p in range(s.pp) for t in range(s.tp)) for d in range(s.dp)]


def sender(producer: tuple[int, ...], consumer: tuple[int, ...]) -> int:
    """The producer-replica rank that sends to a consumer replica: one inside it if any (a local copy)."""
    shared = [r for r in producer if r in consumer]
    return shared[0] if shared else producer[0]


def split_samples(sample_tokens: list[int], dp: int) -> list[list[int]]:
    """Global sample indices of each DP rank (contiguous, token-balanced); empty parts when samples < dp."""
    parts = contiguous_parts(sample_tokens, dp) if sample_tokens else []
    return parts + [[] for _ in range(dp - len(parts))]


class DataFlow:
    """Per-step sample assignment and output transfer for one rank."""

    def __init__(self, graph: DataflowGraph, layouts: dict[str, Layout], rank: int):
        self.graph, self.layouts, self.rank = graph, layouts, rank
        self._comms: dict[tuple[int, ...], object] = {}
        self.meta: dict[tuple[str, tuple[int, ...]], OutputMeta] = {}
        self._dataset_tokens: list[int] = []
        self.ids: list[int] = []

    # -- start-up -------------------------------------------------------------------------------------
    def groups(self, op) -> list[tuple[int, ...]]:
        """Process groups a transfer op may use: sender + consumer replica for every replica pair."""
        out = []
        for prod in replicas(op.src):
            for cons in replicas(op.dst):
                group = tuple(sorted({sender(prod, cons), *cons}))
                if len(group) > 1:
                    out.append(group)
        return out

    def create_comms(self, ops, comm) -> None:
        """MPI sub-communicators for the metadata of each transfer, created in op order by their members."""
        world = comm.Get_group()
        for index, op in enumerate(ops):
            if op.kind != "transfer" or op.ranks in self._comms or self.rank not in op.ranks:
                continue
            group = world.Incl(list(op.ranks))
            self._comms[op.ranks] = comm.Create_group(group, tag=index + 1)  # the tag is the same on every member
            group.Free()

    # -- per step ---------------------------------------------------------------------------------------
    def begin_step(self, ids: list[int], dataset) -> None:
        self.ids = list(ids)
        self.meta = {}
        self._dataset_tokens = dataset.batch(self.ids).sample_tokens() if self.ids else []

    def dataset_positions(self, mfc: MFC, dp_rank: int) -> list[int]:
        """Dataset positions of the samples a DP rank of ``mfc`` reads from the data set."""
        parts = split_samples(self._dataset_tokens, self.layouts[mfc.name].strategy.dp)
        return [self.ids[i] for i in parts[dp_rank]]

    def _gather_meta(self, op, mine: Batch | None) -> OutputMeta:
        # Cached per (producer, op ranks): every member of one transfer communicator must take
        # part in its allgather, even a rank that learnt the producer's layout in an earlier op.
        cache_key = (op.producer, op.ranks)
        if cache_key in self.meta:
            return self.meta[cache_key]
        producer_layout = self.layouts[op.producer]
        coord = producer_layout.coord(self.rank)
        contribution = None
        if coord is not None and coord.tp == 0 and coord.pp == 0 and mine is not None:
            keys = {k: ("tokens", str(v.dtype), tuple(v.shape[1:])) for k, v in mine.tokens.items()}
            keys |= {k: ("seqs", str(v.dtype), tuple(v.shape[1:])) for k, v in mine.seqs.items()}
            contribution = (coord.dp, mine.ids, mine.seqlens, mine.group_size, keys)
        gathered = [c for c in self._comms[op.ranks].allgather(contribution) if c is not None]
        gathered.sort(key=lambda c: c[0])
        group = gathered[0][3] if gathered else 1
        parts, start = [[] for _ in range(producer_layout.strategy.dp)], 0
        for c in gathered:
            count = len(c[2]) // group
            parts[c[0]] = tuple(range(start, start + count))
            start += count
        meta = OutputMeta(tuple(i for c in gathered for i in c[1]), tuple(n for c in gathered for n in c[2]),
                          group, gathered[0][4] if gathered else {}, tuple(tuple(p) for p in parts))
        self.meta[cache_key] = meta
        return meta

    def execute(self, op, mine: Batch | None, groups: ProcessGroups) -> tuple[Batch | None, int]:
        """Move ``op.key`` of the producer's output to the consumer's DP ranks; returns (received, bytes sent)."""
        meta = self._gather_meta(op, mine)
        kind, dtype_name, trailing = meta.keys[op.key]
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        tokens = meta.sample_tokens()
        prod_parts = meta.parts  # as the producer actually split them
        cons_parts = split_samples(tokens, op.dst.strategy.dp)
        prod_replicas, cons_replicas = replicas(op.src), replicas(op.dst)
        g = meta.group_size
        seq_start = [0]
        for n in meta.seqlens:
            seq_start.append(seq_start[-1] + n)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        sent = 0
        pieces: list[torch.Tensor] = []
        my_cons = next((d for d, rep in enumerate(cons_replicas) if self.rank in rep), None)
        for d, cons in enumerate(cons_replicas):
            wanted = set(cons_parts[d])
            for p, prod in enumerate(prod_replicas):
                samples = [i for i in prod_parts[p] if i in wanted]
                if not samples:
                    continue
                src = sender(prod, cons)
                if self.rank != src and self.rank not in cons:
                    continue
                seqs = [i * g + j for i in samples for j in range(g)]
                rows = sum(meta.seqlens[s] for s in seqs) if kind == "tokens" else len(seqs)
                if self.rank == src:
                    offset = prod_parts[p][0]
                    local = mine.select([i - offset for i in samples])[op.key]
                    payload = local.to(device).contiguous()
                else:
                    payload = torch.empty((rows, *trailing), dtype=dtype, device=device)
                receivers = [r for r in cons if r != src]
                if receivers:
                    dist.broadcast(payload, src=src, group=groups.get((src, *receivers)))
                    if self.rank == src:
                        sent += payload.numel() * payload.element_size() * len(receivers)
                if self.rank in cons:
                    pieces.append(payload.cpu())
        if my_cons is None:
            return None, sent
        indices = cons_parts[my_cons]
        if not indices:
            return None, sent
        seqlens = tuple(meta.seqlens[i * g + j] for i in indices for j in range(g))
        value = torch.cat(pieces) if pieces else torch.empty((0, *trailing), dtype=dtype)
        batch = Batch(seqlens, {op.key: value} if kind == "tokens" else {}, {op.key: value} if kind == "seqs" else {},
                      g, tuple(meta.ids[i] for i in indices) if meta.ids else ())
        return batch, sent


def measured_flops(mfc: MFC, cfg: ModelConfig, batch: Batch | None, tokens: int) -> float:
    """Model FLOPs of what an MFC actually processed on one DP replica (3 forwards per trained token)."""
    if not tokens:
        return 0.0
    mean_len = tokens / max(1, batch.n_seqs if batch is not None else 1)
    flops = forward_flops(cfg, tokens, attended_tokens(int(mean_len), None))
    return 3 * flops if mfc.kind == "train_step" else flops
