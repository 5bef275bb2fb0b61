"""What the search is compared with: peer systems' default plans (baselines) and restricted searches.

* **Baselines** (``BASELINES``, built in ``peers.py``): the plans DeepSpeed-Chat, OpenRLHF,
  NeMo-Aligner and verl produce by their documented default rules. No estimator chooses their
  layouts; the estimator scores them (under the peer's own memory strategy).
* **Reference points** (``REFERENCES``): restricted searches, i.e. enumerations with restage's own
  estimator over one family of plans. They show what a fixed family can reach at best, not what
  anyone runs:

  * ``colocated``: every MFC on all devices with the single best strategy;
  * ``separated``: the actor's MFCs on the first half, the rest on the second, the best strategy per half;
  * ``per_model``: every MFC on all devices, each model with its own best strategy;
  * ``gen_optimised``: colocated, generation with its own best strategy on a reallocated copy.

Every builder returns (plan, evaluation) or None when nothing of its kind fits. Plans of baselines
carry estimates under the peer's roles; ``rebased`` re-estimates any plan under the problem's own
roles (what the runtime would run), for the search's starting points and ``plan.mode=heuristic``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from restage.errors import ConfigError
from restage.graph import MFC, MFCKind
from restage.layout import Layout, Strategy
from restage.plan.peers.defaults import BUILDERS as PEER_BUILDERS
from restage.plan.peers.defaults import PEERS
from restage.plan.plan_score import PlanEvaluation, fit_plan
from restage.plan.problem import Plan, PlanProblem, strategies_for, untrainable

BASELINES = PEERS
REFERENCES = ("colocated", "separated", "per_model", "gen_optimised")
LABELS = {
    "deepspeed_chat": "DeepSpeed-Chat default (colocated, ZeRO-3 for all four models, hybrid-engine generation)",
    "openrlhf": "OpenRLHF (fastest of colocate_all_models, paired groups, 4:4:4:2:2 groups; ZeRO-3, vLLM engines)",
    "nemo_aligner": "NeMo-Aligner (actor and critic jobs, fastest split, smallest Megatron TPxPP, PP->TP for generation)",
    "verl": "verl default (colocated, FSDP for all four models, rollout TP by its memory rule)",
    "colocated": "restricted search: colocated, best single strategy",
    "separated": "restricted search: actor / rest on halves, best strategy per half",
    "per_model": "restricted search: colocated, best strategy per model",
    "gen_optimised": "restricted search: colocated, generation with its own best strategy",
}


def rebased(problem: PlanProblem, plan: Plan) -> Plan:
    """The same layouts and micro-batch counts, estimated with ``problem``'s own roles."""
    return tuple(problem.candidate(c.mfc, c.layout, c.micro_batches) for c in plan)


def _common_strategies(problem: PlanProblem, mfcs: Sequence[MFC], size: int) -> list[Strategy]:
    """The strategies of ``size`` ranks every one of ``mfcs`` admits."""
    sets = [set(strategies_for(size, problem.role(m), m, problem.cluster)) for m in mfcs]
    return sorted(set.intersection(*sets)) if sets else []


def _best(results: Iterable[tuple[Plan, PlanEvaluation] | None]) -> tuple[Plan, PlanEvaluation] | None:
    """The fastest of the plans that fit."""
    fitting = [r for r in results if r is not None]
    return min(fitting, key=lambda r: r[1].iteration_seconds) if fitting else None


def colocated(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    return _best(fit_plan(problem, {m.name: Layout.contiguous(0, s) for m in problem.mfcs})
                 for s in _common_strategies(problem, problem.mfcs, world))


def separated(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    world = problem.cluster.world_size
    actor = next((m.model for m in problem.mfcs if m.kind is MFCKind.GENERATE), None)
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
    gens = [m for m in problem.mfcs if m.kind is MFCKind.GENERATE]
    if not gens:
        return None
    rest = [m for m in problem.mfcs if m.kind is not MFCKind.GENERATE]
    results = []
    for s in _common_strategies(problem, rest, world):
        for sg in _common_strategies(problem, gens, world):
            layouts = {m.name: Layout.contiguous(0, sg if m.kind is MFCKind.GENERATE else s) for m in problem.mfcs}
            results.append(fit_plan(problem, layouts))
    return _best(results)


REFERENCE_BUILDERS: dict[str, Callable[[PlanProblem], tuple[Plan, PlanEvaluation] | None]] = {
    "colocated": colocated, "separated": separated, "per_model": per_model, "gen_optimised": gen_optimised,
}
BUILDERS = {**PEER_BUILDERS, **REFERENCE_BUILDERS}


def baseline(problem: PlanProblem, name: str) -> tuple[Plan, PlanEvaluation] | None:
    """A baseline or a reference point by name."""
    if name not in BUILDERS:
        raise ConfigError(f"plan.heuristic: {name!r} is unknown; use one of {', '.join(BUILDERS)}")
    return BUILDERS[name](problem)


def all_baselines(problem: PlanProblem) -> dict[str, tuple[Plan, PlanEvaluation] | None]:
    """The peers' default plans."""
    return {name: PEER_BUILDERS[name](problem) for name in BASELINES}


def all_references(problem: PlanProblem) -> dict[str, tuple[Plan, PlanEvaluation] | None]:
    """The restricted searches."""
    return {name: REFERENCE_BUILDERS[name](problem) for name in REFERENCES}


def starting_plans(problem: PlanProblem, found: dict[str, tuple[Plan, PlanEvaluation] | None]) -> list[Plan]:
    """Every found plan the runtime can train in, re-estimated under the problem's own roles: where the search
    starts."""
    plans = [rebased(problem, got[0]) for got in found.values() if got is not None]
    return [plan for plan in plans if untrainable(problem, plan) is None]
