"""Plan a parameter reallocation: which piece of which parameter goes from which rank to which ranks.

Pure Python over the sharding contract (``models/sharding.py``); no torch.distributed, so the
cost estimator imports it too. Every rank computes the same plan from the same arguments.

A parameter is cut along one axis (its TP ``split_dim``, or axis 0 for a replicated one). The
source shards of a parameter tile that axis, and so do the destination shards; each nonempty
intersection of a source interval with a destination interval is one *piece*. Every DP replica
(and, for a tied embedding, both pipeline stages that hold a copy) of the source interval can
send it. A destination rank that already holds the piece in the source layout copies it
locally; the others receive it from a sender chosen on their node when possible, spreading the
load over the candidate senders.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from restage.errors import PlanError
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.sharding import (
    ShardSpec,
    coord_shard_specs,
    is_adapter,
    param_specs,
    shard_specs,
    unit_of,
    validate_strategy,
)


@dataclass(frozen=True)
class Piece:
    """A block of one parameter moving from ``src_rank`` to every rank in ``dst_ranks``.

    The block is ``[lo, hi)`` along ``dim`` in the coordinates of the full parameter
    (``full_range``); ``src_range`` and ``dst_range`` are the same block in the coordinates of
    the source shard and of each destination shard (the same on every receiver, since all
    receivers hold the same TP chunk). ``src_shape`` / ``dst_shape`` are the local shard shapes.
    """

    name: str
    unit: int  # ordering group: 0 embeddings, 1 + i layer i, num_layers + 1 final norm and head
    dim: int
    full_range: tuple[int, int]
    src_rank: int
    dst_ranks: tuple[int, ...]
    src_range: tuple[int, int]
    dst_range: tuple[int, int]
    src_shape: tuple[int, ...]
    dst_shape: tuple[int, ...]

    @cached_property
    def numel(self) -> int:
        lo, hi = self.full_range
        return (hi - lo) * self.slab_numel

    @cached_property
    def slab_numel(self) -> int:
        """Elements of one index along ``dim``: the smallest block a piece can be cut into."""
        return math.prod(s for d, s in enumerate(self.src_shape) if d != self.dim)

    @cached_property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of the block itself (the source shard's shape with ``dim`` cut to the piece)."""
        shape = list(self.src_shape)
        shape[self.dim] = self.full_range[1] - self.full_range[0]
        return tuple(shape)

    @property
    def whole(self) -> bool:
        """Whether the piece is the whole source shard and the whole destination shard (the same tensor)."""
        return self.src_shape == self.dst_shape and self.numel == math.prod(self.dst_shape)

    def src_contiguous(self) -> bool:
        return _contiguous(self.src_shape, self.dim, self.src_range)

    def dst_contiguous(self) -> bool:
        return _contiguous(self.dst_shape, self.dim, self.dst_range)

    def cut(self, offset: int, length: int) -> Piece:
        """The sub-piece of ``length`` indices along ``dim`` starting ``offset`` into this piece."""
        def shift(r: tuple[int, int]) -> tuple[int, int]:
            return (r[0] + offset, r[0] + offset + length)

        return Piece(self.name, self.unit, self.dim, shift(self.full_range), self.src_rank, self.dst_ranks,
                     shift(self.src_range), shift(self.dst_range), self.src_shape, self.dst_shape)


def _contiguous(shape: tuple[int, ...], dim: int, rng: tuple[int, int]) -> bool:
    """Whether ``tensor[..., lo:hi (on dim), ...]`` of a contiguous tensor of ``shape`` is contiguous."""
    if math.prod(shape[:dim]) == 1:
        return True
    return rng == (0, shape[dim]) or math.prod(shape[dim + 1:]) == 0


@dataclass(frozen=True, eq=False)  # compared by identity: hashing thousands of pieces per lookup would cost ms
class ReallocPlan:
    """Everything that moves (``pieces``) or is copied in place (``local_pieces``) in one reallocation.

    ``bytes_by_link[(src, dst)]`` counts the bytes ``dst`` receives from ``src``: a piece
    broadcast to k receivers adds its bytes to k links. ``lower_bound_bytes`` counts, for every
    destination rank, the bytes of its destination shard it does not hold in the source layout.
    """

    cfg: ModelConfig
    src: Layout
    dst: Layout
    bytes_per_element: int
    pieces: tuple[Piece, ...]
    local_pieces: tuple[Piece, ...]
    bytes_by_link: dict[tuple[int, int], int] = field(hash=False)
    lower_bound_bytes: int
    adapters_only: bool = False  # a LoRA model into a copy that holds its base: only the trained parameters move

    def moves(self, name: str) -> bool:
        """Whether parameter ``name`` is part of this reallocation."""
        return not self.adapters_only or is_adapter(self.cfg, name)

    def destination_specs(self, rank: int) -> list[ShardSpec]:
        """The shards ``rank`` receives or copies (none if it is not in the destination)."""
        coord = self.dst.coord(rank)
        if coord is None:
            return []
        return [s for s in coord_shard_specs(self.cfg, self.dst.strategy, coord) if self.moves(s.param.name)]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_by_link.values())

    @property
    def local_bytes(self) -> int:
        return sum(p.numel for p in self.local_pieces) * self.bytes_per_element

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank that takes part (holds a source or a destination shard)."""
        return tuple(sorted(set(self.src.mesh) | set(self.dst.mesh)))

    def sent_bytes_by_rank(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (s, _), n in self.bytes_by_link.items():
            out[s] += n
        return dict(out)

    def received_bytes_by_rank(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (_, d), n in self.bytes_by_link.items():
            out[d] += n
        return dict(out)

    def summary(self) -> str:
        return (f"{self.src} -> {self.dst}: {len(self.pieces)} pieces, {self.total_bytes} bytes sent "
                f"(lower bound {self.lower_bound_bytes}), {self.local_bytes} bytes copied locally")


def check_layouts(cfg: ModelConfig, src: Layout, dst: Layout, world_size: int | None = None) -> None:
    """Refuse, in one line, layouts the model cannot take or that name ranks outside the world."""
    for role, layout in (("source", src), ("destination", dst)):
        validate_strategy(cfg, layout.strategy, name=f"{role} layout {layout}")
        if world_size is not None:
            layout.check_world(world_size)


@dataclass
class _Holding:
    """Ranks holding one interval of one parameter, with the interval's local geometry."""

    interval: tuple[int, int]
    ranks: list[int]
    shape: tuple[int, ...]


def _holdings(cfg: ModelConfig, layout: Layout) -> dict[str, list[_Holding]]:
    """For each parameter, its intervals along the cut axis and every rank holding each."""
    s = layout.strategy
    by_name: dict[str, dict[tuple[int, int], _Holding]] = defaultdict(dict)
    for pp, tp, ep_rank in ((p, t, e) for p in range(s.pp) for t in range(s.tp) for e in range(s.ep)):
        everyone = [layout.rank_at(pp, d, tp) for d in range(s.dp)]
        # an expert is held by the dp ranks of its ep-rank only; the rest by every dp rank (listed once)
        experts = [layout.rank_at(pp, d, tp) for d in range(ep_rank, s.dp, s.ep)]
        for shard in shard_specs(cfg, s, pp, tp, ep_rank if s.ep > 1 else None):
            if shard.param.expert is None and ep_rank > 0:
                continue
            ranks = everyone if shard.param.expert is None else experts
            interval = (shard.start, shard.stop) if shard.param.split_dim is not None else (0, shard.param.shape[0])
            held = by_name[shard.param.name].get(interval)
            if held is None:
                by_name[shard.param.name][interval] = _Holding(interval, list(ranks), shard.shape)
            else:  # the tied embedding's copy on the last stage
                held.ranks.extend(ranks)
    return {name: sorted(h.values(), key=lambda x: x.interval) for name, h in by_name.items()}


# What a piece's closure binds: name, unit, dim, lo, hi, the sender's holding and the receiver's.
_PieceAt = tuple[str, int, int, int, int, _Holding, _Holding]


def _piece(name: str, unit: int, dim: int, lo: int, hi: int, have: _Holding, want: _Holding,
           sender: int, receivers: tuple[int, ...]) -> Piece:
    return Piece(name, unit, dim, (lo, hi), sender, receivers, (lo - have.interval[0], hi - have.interval[0]),
                 (lo - want.interval[0], hi - want.interval[0]), have.shape, want.shape)


def contiguous_chunks(items: list[int], parts: int) -> list[list[int]]:
    """``items`` cut into ``parts`` contiguous, near-equal chunks (the first ones one longer where they do not divide)."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        out.append(items[start:stop])
        start = stop
    return out


def plan_reallocation(cfg: ModelConfig, src: Layout, dst: Layout, *, bytes_per_element: int,
                      node_of: Callable[[int], int] = lambda r: 0, world_size: int | None = None,
                      adapters_only: bool = False) -> ReallocPlan:
    """Plan moving a model's parameters from layout ``src`` to layout ``dst``.

    ``node_of(rank)`` names the node of a global rank: a receiver takes a piece from a sender
    on its own node when one holds it. Among the candidate senders (the source DP replicas of
    the piece) the least-loaded are chosen, and the receivers on one node are split over as
    many local candidates as there are, so DP replicas share the work. Receivers on a node with
    no candidate share one sender (the bytes cross nodes once per node). Raises LayoutError
    (one line) if either layout does not fit the model or, given ``world_size``, the world.
    ``adapters_only``: move only a LoRA model's trained parameters (the destination holds the base).
    """
    check_layouts(cfg, src, dst, world_size)
    if bytes_per_element < 1:
        raise PlanError(f"bytes_per_element={bytes_per_element} must be positive")

    specs = {spec.name: spec for spec in param_specs(cfg)}
    src_hold, dst_hold = _holdings(cfg, src), _holdings(cfg, dst)
    load: dict[int, int] = defaultdict(int)  # bytes each sender has been given so far
    pieces: list[Piece] = []
    local: list[Piece] = []
    links: dict[tuple[int, int], int] = defaultdict(int)
    lower_bound = 0
    for name, spec in specs.items():
        if name not in dst_hold or (adapters_only and not is_adapter(cfg, name)):
            continue
        dim = spec.split_dim if spec.split_dim is not None else 0
        unit = unit_of(cfg, spec)
        for want in dst_hold[name]:
            for have in src_hold[name]:
                lo, hi = max(want.interval[0], have.interval[0]), min(want.interval[1], have.interval[1])
                if lo >= hi:
                    continue

                def piece(sender: int, receivers: tuple[int, ...], *,
                          _at: _PieceAt = (name, unit, dim, lo, hi, have, want)) -> Piece:
                    return _piece(*_at, sender, receivers)

                holders = set(have.ranks)
                receivers = sorted(r for r in want.ranks if r not in holders)
                for r in sorted(set(want.ranks) & holders):
                    local.append(piece(r, (r,)))
                if not receivers:
                    continue
                numel = (hi - lo) * math.prod(s for d, s in enumerate(spec.shape) if d != dim)
                nbytes = numel * bytes_per_element
                lower_bound += nbytes * len(receivers)
                by_node: dict[int, list[int]] = defaultdict(list)
                for r in receivers:
                    by_node[node_of(r)].append(r)
                candidates = sorted(holders)
                for node in sorted(by_node):
                    group = by_node[node]
                    near = [c for c in candidates if node_of(c) == node]
                    senders = near or candidates
                    chunks = contiguous_chunks(group, min(len(senders), len(group))) if near else [group]
                    ranked = sorted(senders, key=lambda c: (load[c], c))
                    for sender, chunk in zip(ranked, chunks):
                        load[sender] += nbytes * len(chunk)
                        pieces.append(piece(sender, tuple(chunk)))
                        for r in chunk:
                            links[(sender, r)] += nbytes
    return ReallocPlan(cfg, src, dst, bytes_per_element, tuple(pieces), tuple(local), dict(links), lower_bound,
                       adapters_only)


def realloc_groups(plan: ReallocPlan) -> list[tuple[int, ...]]:
    """The one process group the plan's batched sends and receives run on: every rank of src and dst.

    One group per reallocation (not one per broadcast): each NCCL communicator costs GPU memory
    and set-up time, so the executor sends a message to k receivers as k sends in one batch.
    """
    return [plan.ranks] if len(plan.ranks) > 1 else []


def destination_shard_bytes(plan: ReallocPlan, rank: int) -> int:
    """Bytes of the destination shard ``rank`` receives or copies (0 if not in the destination)."""
    return sum(s.numel for s in plan.destination_specs(rank)) * plan.bytes_per_element
