"""Score a plan: simulated iteration time and peak memory on every rank.

Memory per rank = persistent state of every model whose home mesh covers the rank (parameters,
and for trained models gradients and optimizer states per ZeRO stage) + the largest transient
need among the MFCs that run on it (activations, KV cache, and the parameter copy of an MFC
that runs on a reallocated layout). A plan is feasible when no rank exceeds the cluster's usable
memory per device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from restage.graph import MFCKind
from restage.layout import Layout
from restage.plan.problem import Plan, PlanProblem
from restage.plan.simulator import Timeline, needs_copy, steady_state, zero3_in_place, zero3_in_place_bytes

# Infeasible plans are kept comparable so the search can walk out of them: each byte over the
# limit (as a fraction of the limit) costs this many times the iteration time.
OVERFLOW_PENALTY = 10.0


@dataclass(frozen=True)
class PlanEvaluation:
    iteration_seconds: float
    peak_memory_bytes: int  # the fullest rank
    capacity_bytes: int
    mfc_seconds: tuple[float, ...]
    mfc_peak_memory_bytes: tuple[int, ...]  # per MFC: the fullest of its ranks while it runs
    timeline: Timeline

    @property
    def feasible(self) -> bool:
        return self.peak_memory_bytes <= self.capacity_bytes

    @property
    def cost(self) -> float:
        """The search's objective: seconds, inflated for plans that do not fit."""
        over = max(0, self.peak_memory_bytes - self.capacity_bytes) / self.capacity_bytes
        return self.iteration_seconds * (1.0 + OVERFLOW_PENALTY * over) + (1e6 if over > 0 else 0.0)


def _ranks(layout: Layout) -> slice | npt.NDArray[np.int64]:
    """The layout's ranks as an index into a per-rank array: a slice where they are contiguous."""
    mesh = layout.mesh
    if mesh[-1] - mesh[0] + 1 == len(mesh):
        return slice(mesh[0], mesh[-1] + 1)
    return np.asarray(mesh)


def plan_memory(problem: PlanProblem, plan: Plan) -> tuple[int, tuple[int, ...]]:
    """(peak bytes of the fullest rank, each MFC's peak bytes) for ``plan``.

    Persistent: each model's home state, and the copies of frozen and LoRA models on other layouts (the
    runtime keeps those). Transient, per MFC: its activations / KV cache, plus its parameters when
    it runs on a copy of a trained model, on a ZeRO-3 gather, or on an offloaded frozen model.
    """
    world = max(problem.cluster.world_size, max(c.layout.mesh[-1] for c in plan) + 1)
    persistent = np.zeros(world)
    for model, home_name in problem.home.items():
        role = problem.roles[model]
        home = plan[problem.index[home_name]]
        if role.trainable or not role.offload_when_idle:
            persistent[_ranks(home.layout)] += home.estimate.state_bytes
    frozen_copies = set()
    transient_max = np.zeros(world)
    needs = []
    for mfc, cand in zip(problem.mfcs, plan):
        role = problem.role(mfc)
        need = cand.estimate.transient_bytes
        copy = needs_copy(problem, plan, mfc)
        kept = not role.trainable or role.arch.lora is not None  # a LoRA model's copies keep their base
        kept = kept or (problem.execution is not None and mfc.kind is MFCKind.GENERATE)  # async: the generation copy stays
        if copy and kept and not role.offload_when_idle:
            if (mfc.model, cand.layout) not in frozen_copies:
                frozen_copies.add((mfc.model, cand.layout))
                persistent[_ranks(cand.layout)] += cand.estimate.param_bytes
        elif zero3_in_place(problem, plan, mfc):
            need += zero3_in_place_bytes(problem, plan, mfc)
        elif copy or (not role.trainable and role.offload_when_idle):
            need += cand.estimate.param_bytes
        idx = _ranks(cand.layout)
        transient_max[idx] = np.maximum(transient_max[idx], need)
        needs.append((idx, need))
    peaks = tuple(int(persistent[idx].max() + need) for idx, need in needs)
    return int((persistent + transient_max).max()), peaks


def evaluate(problem: PlanProblem, plan: Plan) -> PlanEvaluation:
    seconds, timeline = steady_state(problem, plan, overlap=problem.overlap_iterations)
    peak, mfc_peaks = plan_memory(problem, plan)
    return PlanEvaluation(iteration_seconds=seconds, peak_memory_bytes=peak,
                          capacity_bytes=problem.capacity_bytes, mfc_seconds=tuple(c.seconds for c in plan),
                          mfc_peak_memory_bytes=mfc_peaks, timeline=timeline)


def fit_plan(problem: PlanProblem, layouts: dict[str, Layout]) -> tuple[Plan, PlanEvaluation] | None:
    """The fastest micro-batch counts for these layouts that fit in memory, or None."""
    options = [[c for c in problem.options(m, layouts[m.name]) if problem.fits_alone(c)] for m in problem.mfcs]
    if any(not o for o in options):
        return None
    # Level k gives every MFC its k-th leanest-but-one option: more micro-batches, less memory.
    by_memory = [sorted(o, key=lambda c: (c.micro_batches, c.seconds)) for o in options]
    fastest = tuple(min(o, key=lambda c: c.seconds) for o in options)
    tried = [fastest] + [tuple(o[min(k, len(o) - 1)] for o in by_memory) for k in range(max(map(len, by_memory)))]
    for plan in tried:
        ev = evaluate(problem, plan)
        if ev.feasible:
            return plan, ev
    return None
