"""What a run puts on the interconnect, derived from its schedule alone: where each rank runs, which
process groups it creates, and a bound on its communicators and point-to-point rank pairs.

Every torch.distributed group is an NCCL communicator on GPUs (GPU memory for its buffers, set-up
time, never freed), and so is every pair of ranks that exchanges *unbatched* sends and receives.
A run creates only: the groups of each MFC's layout (``Layout.all_groups``: tp, dp, pp, model-parallel
tp x pp, ep and expert-dp, and the whole mesh), one group per
reallocation (the ranks of its source and destination, often a layout's mesh already), and the
single-rank groups DeepSpeed asks for. Data transfers use MPI (no group), reallocations and the
pipeline use batched sends and receives (no per-pair communicator). So the count is
O(layouts x groups per layout), whatever the number of DP ranks, and the runtime logs it at start.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import assert_never

from restage.errors import ConfigError
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.schedule.file import Schedule
from restage.schedule.ops import Ema, Free, Generate, Offload, Op, Push, Realloc, Reload, Run, SendKey, TakeBuffered
from restage.schedule.realloc_plan import ReallocPlan, plan_reallocation


def ranks_per_node(schedule: Schedule) -> int:
    """Ranks per node: the launcher's ``RESTAGE_RANKS_PER_NODE`` if set, else the schedule's cluster (as planned)."""
    value = os.environ.get("RESTAGE_RANKS_PER_NODE") or schedule.cluster.devices_per_node
    not_whole = ConfigError(f"ranks per node {value!r} is not a whole number; set RESTAGE_RANKS_PER_NODE")
    if value is None:
        raise not_whole
    try:
        per_node = int(value)
    except (TypeError, ValueError):
        raise not_whole from None
    if per_node < 1:
        raise ConfigError(f"ranks per node {per_node} must be >= 1; set RESTAGE_RANKS_PER_NODE")
    return per_node


def _block(per_node: int, rank: int) -> int:
    return rank // per_node


def block_node_of(per_node: int) -> Callable[[int], int]:
    """``node_of(rank)`` of block placement (``launch.geometry``): rank r runs on node r // per_node."""
    return functools.partial(_block, per_node)


def realloc_model_config(schedule: Schedule, name: str) -> ModelConfig:
    """The architecture a model's parameters are reallocated in (with its value head where it has one)."""
    return schedule.models[name].held_arch


def realloc_ranks(src: Layout, dst: Layout) -> tuple[int, ...]:
    """The one group a reallocation runs on (``realloc_plan.realloc_groups``), from its layouts alone."""
    return tuple(sorted(set(src.mesh) | set(dst.mesh)))


def parameter_move(op: Op) -> Realloc | Ema | Push | None:
    """``op`` if it reallocates parameters (a reallocation, an async weight push, or the one inside an EMA), else None."""
    match op:
        case Realloc() | Ema() | Push():
            return op
        case Run() | SendKey() | Free() | Offload() | Reload() | Generate() | TakeBuffered():
            return None
        case _:
            assert_never(op)


def run_groups(layouts: Iterable[Layout], ops: Iterable[Op]) -> list[tuple[int, ...]]:
    """Every multi-rank group a run creates, sorted: each layout's groups, then one per reallocation or EMA op."""
    wanted: set[tuple[int, ...]] = set()
    for layout in set(layouts):
        wanted |= {tuple(sorted(g)) for g in layout.all_groups()}
    for op in ops:
        if (move := parameter_move(op)) is not None:
            ranks = realloc_ranks(move.src, move.dst)
            if len(ranks) > 1:
                wanted.add(ranks)
    return sorted(wanted)


def singleton_ranks(schedule: Schedule) -> list[int]:
    """Ranks that need a one-rank group: DeepSpeed asks its mpu for the dp, tp and model-parallel groups (and
    the engine's barrier group) of a trainable model, which is one rank wherever that degree is 1."""
    out: set[int] = set()
    for info in schedule.models.values():
        if info.trainable:
            out |= set(engine_singleton_ranks(info.home_layout))
    return sorted(out)


def engine_singleton_ranks(layout: Layout) -> tuple[int, ...]:
    """The ranks of a training layout whose DeepSpeed mpu hands out a one-rank group (dp, tp or tp x pp of 1)."""
    s = layout.strategy
    return layout.mesh if s.dp == 1 or s.tp == 1 or layout.size == 1 else ()


def pipeline_pairs(layouts: Iterable[Layout]) -> set[tuple[int, int]]:
    """Rank pairs the pipeline exchanges activations over: adjacent stages, and first with last (tied embeddings)."""
    pairs: set[tuple[int, int]] = set()
    for layout in set(layouts):
        s = layout.strategy
        for d in range(s.dp):
            for t in range(s.tp):
                stages = [layout.rank_at(p, d, t) for p in range(s.pp)]
                pairs |= {_unordered(a, b) for a, b in zip(stages, stages[1:])}
                if s.pp > 1:
                    pairs.add(_unordered(stages[0], stages[-1]))
    return pairs


def _unordered(a: int, b: int) -> tuple[int, int]:
    """The pair of ranks ``a``, ``b`` lowest first: one key for either direction."""
    return (a, b) if a <= b else (b, a)


@dataclass(frozen=True)
class CommunicatorBound:
    """The most a run may create: ``groups`` (``dist.new_group`` calls) and ``pairs`` (unordered P2P rank pairs)."""

    groups: tuple[tuple[int, ...], ...]  # multi-rank and single-rank groups, in creation order
    pairs: frozenset[tuple[int, int]]

    @property
    def max_groups(self) -> int:
        """``dist.new_group`` calls (the default world group comes on top: ``max_communicators``)."""
        return len(self.groups)

    @property
    def max_communicators(self) -> int:
        return len(self.groups) + 1

    @property
    def max_pairs(self) -> int:
        return len(self.pairs)

    def summary(self) -> str:
        lone = sum(1 for g in self.groups if len(g) == 1)
        return (f"communicators: at most {self.max_communicators} (world + {self.max_groups - lone} groups + "
                f"{lone} single-rank), {self.max_pairs} point-to-point rank pairs")


def communicator_bound(schedule: Schedule, realloc_plan: Callable[[str, Layout, Layout], ReallocPlan] | None = None
                       ) -> CommunicatorBound:
    """The bound for a schedule. ``realloc_plan(model, src, dst)`` gives a ReallocPlan (the runtime passes its
    cached planner); by default plans are made here with the schedule's node placement."""
    ops = schedule.ops()
    layouts = [entry.layout for entry in schedule.mfcs]
    if realloc_plan is None:
        node_of = block_node_of(ranks_per_node(schedule))
        dtypes = {"fp32": 4, "bf16": 2, "fp16": 2}

        def realloc_plan(model: str, src: Layout, dst: Layout) -> ReallocPlan:
            return plan_reallocation(realloc_model_config(schedule, model), src, dst,
                                     bytes_per_element=dtypes[schedule.models[model].dtype], node_of=node_of)

    pairs = pipeline_pairs(layouts)
    for op in ops:
        if (move := parameter_move(op)) is not None:
            model = move.model if isinstance(move, Realloc | Push) else schedule.mfc(move.mfc).model  # an EMA moves the trained one
            plan = realloc_plan(model, move.src, move.dst)
            pairs |= {_unordered(*link) for link in plan.bytes_by_link}
    groups = tuple(run_groups(layouts, ops)) + tuple((r,) for r in singleton_ranks(schedule))
    return CommunicatorBound(groups, frozenset(pairs))
