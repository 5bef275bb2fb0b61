"""The terms every MFC's cost on a layout is made of: the slowest group of each kind, the slowest pipeline stage,
the sequences a DP rank handles, the expert exchange under ep."""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, assert_never

from restage.cluster import ClusterSpec
from restage.graph import MFC, MFCKind
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.sharding import stage_layers
from restage.plan.comm import alltoall_seconds

# The process groups of a layout: tensor, data, pipeline, expert and expert-data parallel.
GroupKind = Literal["tp", "dp", "pp", "ep", "edp"]


class MFCCost(NamedTuple):
    """What the cost of one MFC kind comes to on one rank: seconds, bytes held only while it runs, seconds by part."""

    seconds: float
    transient_bytes: float
    parts: dict[str, float]


def worst_group(layout: Layout, kind: GroupKind) -> tuple[int, ...]:
    """The group of ``kind`` with the most ranks, the widest spread on a tie: the one whose links are slowest."""
    match kind:
        case "tp":
            groups = layout.tp_groups()
        case "dp":
            groups = layout.dp_groups()
        case "pp":
            groups = layout.pp_groups()
        case "ep":
            groups = layout.ep_groups()
        case "edp":
            groups = layout.edp_groups()
        case _:
            assert_never(kind)
    return max(groups, key=lambda g: (len(g), g[-1] - g[0]))


def stage_seconds(layout: Layout, cfg: ModelConfig, per_block: float, first: float, last: float) -> float:
    """Time of the slowest pipeline stage given per-block, first-stage-extra and last-stage-extra seconds."""
    ranges = stage_layers(cfg, layout.strategy.pp)
    pp = len(ranges)
    return max((hi - lo) * per_block + (first if i == 0 else 0) + (last if i == pp - 1 else 0)
               for i, (lo, hi) in enumerate(ranges))


def max_stage_layers(cfg: ModelConfig, pp: int) -> int:
    """Blocks of the pipeline stage with the most."""
    return max(hi - lo for lo, hi in stage_layers(cfg, pp))


def passes_per_call(mfc: MFC) -> int:
    """How many parts an epoch of ``mfc``'s batch is split into: a train step's optimizer steps, else one pass."""
    match mfc.kind:
        case MFCKind.TRAIN_STEP:
            return mfc.minibatches
        case MFCKind.GENERATE | MFCKind.INFERENCE:
            return 1
        case _:
            assert_never(mfc.kind)


def dp_size_ok(mfc: MFC, dp: int) -> bool:
    """Every DP rank needs at least one sequence per optimizer step (or per pass)."""
    return mfc.n_seqs >= dp * passes_per_call(mfc)


def sequences_per_rank(mfc: MFC, dp: int) -> float:
    """Sequences one DP rank handles per pass (train: per optimizer step)."""
    return math.ceil(mfc.n_seqs / (dp * passes_per_call(mfc)))


def expert_exchange_seconds(cluster: ClusterSpec, cfg: ModelConfig, layout: Layout, tokens: float, e: int) -> float:
    """One pass of the most loaded stage's sparse layers over ``tokens`` tokens under ep: two all-to-alls each
    (to the experts and back), every rank sending ``tokens * hidden * top_k * bytes * (ep - 1) / ep``, over
    the ep group's link (intra- or inter-node by where the group sits). 0 without ep."""
    s = layout.strategy
    if s.ep == 1 or not cfg.is_moe:
        return 0.0
    sparse = max(sum(1 for i in range(lo, hi) if cfg.is_sparse(i)) for lo, hi in stage_layers(cfg, s.pp))
    rows = tokens * cfg.hidden_size * cfg.experts_per_token * e
    return sparse * 2 * alltoall_seconds(cluster, worst_group(layout, "ep"), rows)
