"""Heuristic plans the search must beat, built from the same estimator and simulator.

* ``colocated``: every MFC on all devices with one strategy (DeepSpeed-Chat's and verl's default).
* ``separated``: the actor's MFCs on the first half of the devices, every other MFC on the
  second half, one strategy per half (OpenRLHF's split).
* ``per_model``: every MFC on all devices; each model takes its own best strategy.
* ``gen_optimised``: colocated, but generation takes its own best strategy and runs on a
  reallocated copy (DeepSpeed-Chat's hybrid engine).
* ``megatron``: colocated with the Megatron-LM rule instead of a search: TP over a whole node,
  the fewest pipeline stages that fit, DP over the rest (the heuristic the ReaLHF paper compares
  its searched plans with).

Except ``megatron``, each baseline picks its strategies by enumeration (minimising the simulated iteration time) and
the micro-batch counts that make the plan fit; a baseline that fits nowhere is None.
"""

from __future__ import annotations

from collections.abc import Callable

from restage.layout import Layout, Strategy
from restage.plan.evaluate import PlanEvaluation, evaluate
from restage.plan.problem import Plan, PlanProblem, strategies_for

BASELINES = ("colocated", "separated", "per_model", "gen_optimised", "megatron")


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


def _common_strategies(problem: PlanProblem, mfcs, size: int) -> list[Strategy]:
    sets = [set(strategies_for(size, problem.role(m), m, problem.cluster)) for m in mfcs]
    return sorted(set.intersection(*sets)) if sets else []


def _best(results) -> tuple[Plan, PlanEvaluation] | None:
    results = [r for r in results if r is not None]
    return min(results, key=lambda r: r[1].iteration_seconds) if results else None


def colocated(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    return _best(fit_plan(problem, {m.name: Layout.contiguous(0, s) for m in problem.mfcs})
                 for s in _common_strategies(problem, problem.mfcs, world))


def separated(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    actor = next((m.model for m in problem.mfcs if m.kind == "generate"), None)
    group_a = [m for m in problem.mfcs if m.model == actor]
    group_b = [m for m in problem.mfcs if m.model != actor]
    if world < 2 or not group_a or not group_b:
        return None
    half = world // 2
    results = []
    for sa in _common_strategies(problem, group_a, half):
        for sb in _common_strategies(problem, group_b, world - half):
            layouts = {m.name: Layout.contiguous(0, sa) for m in group_a}
            layouts.update({m.name: Layout.contiguous(half, sb) for m in group_b})
            results.append(fit_plan(problem, layouts))
    return _best(results)


def per_model(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    start = colocated(problem)
    if start is None:
        return None
    choice = {model: start[0][0].layout.strategy for model in problem.roles}
    best = start
    for _ in range(2):  # coordinate descent over models
        for model in problem.graph.models():
            mfcs = [m for m in problem.mfcs if m.model == model]
            for s in _common_strategies(problem, mfcs, world):
                trial = {**choice, model: s}
                got = fit_plan(problem, {m.name: Layout.contiguous(0, trial[m.model]) for m in problem.mfcs})
                if got is not None and got[1].iteration_seconds < best[1].iteration_seconds:
                    best, choice = got, trial
    return best


def gen_optimised(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    gens = [m for m in problem.mfcs if m.kind == "generate"]
    if not gens:
        return None
    rest = [m for m in problem.mfcs if m.kind != "generate"]
    results = []
    for s in _common_strategies(problem, rest, world):
        for sg in _common_strategies(problem, gens, world):
            layouts = {m.name: Layout.contiguous(0, sg if m.kind == "generate" else s) for m in problem.mfcs}
            results.append(fit_plan(problem, layouts))
    return _best(results)


def megatron(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    common = _common_strategies(problem, problem.mfcs, world)
    if not common:
        return None
    tp = max(s.tp for s in common)
    for pp in sorted({s.pp for s in common if s.tp == tp}):
        got = fit_plan(problem, {m.name: Layout.contiguous(0, Strategy(dp=world // (tp * pp), tp=tp, pp=pp))
                                 for m in problem.mfcs})
        if got is not None:
            return got
    return None


BUILDERS: dict[str, Callable[[PlanProblem], tuple[Plan, PlanEvaluation] | None]] = {
    "colocated": colocated, "separated": separated, "per_model": per_model, "gen_optimised": gen_optimised,
    "megatron": megatron,
}


def baseline(problem: PlanProblem, name: str) -> tuple[Plan, PlanEvaluation] | None:
    from restage.errors import ConfigError

    if name not in BUILDERS:
        raise ConfigError(f"plan.heuristic: {name!r} is unknown; use one of {', '.join(BASELINES)}")
    return BUILDERS[name](problem)


def all_baselines(problem: PlanProblem) -> dict[str, tuple[Plan, PlanEvaluation] | None]:
    return {name: build(problem) for name, build in BUILDERS.items()}
