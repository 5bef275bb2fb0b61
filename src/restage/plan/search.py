"""Search for the plan with the shortest simulated iteration that fits in memory.

Small problems (few enough plans) are enumerated exactly (within the time budget, unless
``method="exhaustive"`` insists). Otherwise a seeded simulated
annealing (Metropolis acceptance on the relative change of the cost, cooling in cycles that
restart from the best plan so far) walks from the best of the given starting plans, and a
coordinate-descent pass polishes the result. Moves change one MFC's candidate: to any candidate,
to another strategy on the same mesh, to the same strategy on another mesh of that size, or to
its model's home layout (which removes a reallocation).

For a given seed the result depends only on the number of steps: ``max_steps`` or
``patience_steps`` without improvement end the search deterministically, ``time_budget_seconds``
is a cap (the result says which one stopped it).
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, assert_never

from restage.layout import Strategy
from restage.plan.plan_score import PlanEvaluation, evaluate
from restage.plan.problem import Candidate, Plan, PlanProblem

EXHAUSTIVE_LIMIT = 5000  # plans; problems with at most this many are enumerated exactly
CYCLE_STEPS = 1500
PATIENCE_STEPS = 4 * CYCLE_STEPS  # stop once this many steps have not improved the best plan
START_TEMPERATURE, END_TEMPERATURE = 0.3, 0.003


SearchMethod = Literal["exhaustive", "anneal"]  # how a search ran
StoppedBy = Literal["exhausted", "steps", "converged", "time"]  # why it ended


@dataclass(frozen=True)
class SearchResult:
    best: Plan
    evaluation: PlanEvaluation
    top: tuple[tuple[Plan, PlanEvaluation], ...]  # the best few distinct feasible plans, best first
    method: SearchMethod
    steps: int
    wall_seconds: float
    stopped_by: StoppedBy


class _Top:
    """The best few distinct plans seen."""

    def __init__(self, k: int):
        self.k = k
        self.items: dict[Plan, PlanEvaluation] = {}

    def add(self, plan: Plan, ev: PlanEvaluation) -> None:
        if not ev.feasible or plan in self.items:
            return
        if len(self.items) < self.k or ev.cost < max(e.cost for e in self.items.values()):
            self.items[plan] = ev
            if len(self.items) > self.k:
                del self.items[max(self.items, key=lambda p: self.items[p].cost)]

    def sorted(self) -> tuple[tuple[Plan, PlanEvaluation], ...]:
        return tuple(sorted(self.items.items(), key=lambda kv: kv[1].cost))


def plan_count(problem: PlanProblem) -> int:
    return math.prod(len(problem.candidates(m)) for m in problem.mfcs)


def search(problem: PlanProblem, *, seed: int = 1, time_budget_seconds: float = 30.0, max_steps: int = 40000,
           initial: Sequence[Plan] = (), method: SearchMethod | Literal["auto"] = "auto", top_k: int = 5,
           patience_steps: int = PATIENCE_STEPS) -> SearchResult:
    """Best plan for ``problem``; ``method`` is auto, exhaustive or anneal."""
    started = time.perf_counter()
    match method:
        case "exhaustive":
            return _exhaustive(problem, top_k, started, float("inf"))
        case "auto" if plan_count(problem) <= EXHAUSTIVE_LIMIT:
            return _exhaustive(problem, top_k, started, time_budget_seconds)
        case "auto" | "anneal":
            return _anneal(problem, seed, time_budget_seconds, max_steps, initial, top_k, started, patience_steps)
        case _:
            assert_never(method)


def _exhaustive(problem: PlanProblem, top_k: int, started: float, budget: float) -> SearchResult:
    top = _Top(top_k)
    best: Plan | None = None
    best_ev: PlanEvaluation | None = None
    steps = 0
    stopped_by: StoppedBy = "exhausted"
    for plan in itertools.product(*(problem.candidates(m) for m in problem.mfcs)):
        if steps % 64 == 0 and steps and time.perf_counter() - started > budget:
            stopped_by = "time"
            break
        ev = evaluate(problem, plan)
        steps += 1
        top.add(plan, ev)
        if best_ev is None or ev.cost < best_ev.cost:
            best, best_ev = plan, ev
    if best is None or best_ev is None:  # set together: both or neither
        raise ValueError("no candidates to enumerate")
    return SearchResult(best, best_ev, top.sorted(), "exhaustive", steps, time.perf_counter() - started, stopped_by)


class _Moves:
    """Indexes over each MFC's candidates for the neighbourhood moves."""

    def __init__(self, problem: PlanProblem):
        self.problem = problem
        self.cands = [problem.candidates(m) for m in problem.mfcs]
        self.by_mesh: list[dict[tuple[int, ...], list[Candidate]]] = []
        self.by_shape: list[dict[tuple[Strategy, int], list[Candidate]]] = []
        for cands in self.cands:
            mesh: dict[tuple[int, ...], list[Candidate]] = defaultdict(list)
            shape: dict[tuple[Strategy, int], list[Candidate]] = defaultdict(list)
            for c in cands:
                mesh[c.layout.mesh].append(c)
                shape[(c.layout.strategy, c.micro_batches)].append(c)
            self.by_mesh.append(dict(mesh))
            self.by_shape.append(dict(shape))

    def propose(self, plan: Plan, rng: random.Random) -> Plan:
        i = rng.randrange(len(plan))
        current = plan[i]
        kind = rng.random()
        if kind < 0.35:
            new = rng.choice(self.cands[i])
        elif kind < 0.6:
            new = rng.choice(self.by_mesh[i].get(current.layout.mesh) or self.cands[i])
        elif kind < 0.85:
            new = rng.choice(self.by_shape[i].get((current.layout.strategy, current.micro_batches)) or self.cands[i])
        else:
            new = self._align(plan, i, rng)
        return plan[:i] + (new,) + plan[i + 1:]

    def _align(self, plan: Plan, i: int, rng: random.Random) -> Candidate:
        """Put MFC ``i`` on its model's home layout, or the home MFC on MFC ``i``'s layout."""
        problem = self.problem
        mfc = problem.mfcs[i]
        home = problem.index[problem.home[mfc.model]]
        if home == i:
            others = [j for j, m in enumerate(problem.mfcs) if m.model == mfc.model and j != i]
            if not others:
                return rng.choice(self.cands[i])
            layout = plan[rng.choice(others)].layout
        else:
            layout = plan[home].layout
        options = [c for c in self.by_mesh[i].get(layout.mesh, ()) if c.layout == layout]
        return min(options, key=lambda c: c.seconds) if options else plan[i]


def _greedy_start(problem: PlanProblem) -> Plan:
    """Each MFC's fastest candidate: often infeasible, but a quick start when no other plan is given."""
    return tuple(min(problem.candidates(m), key=lambda c: c.seconds) for m in problem.mfcs)


def _anneal(problem: PlanProblem, seed: int, budget: float, max_steps: int, initial: Sequence[Plan], top_k: int,
            started: float, patience: int) -> SearchResult:
    rng = random.Random(seed)
    moves = _Moves(problem)
    if any(not c for c in moves.cands):
        empty = [m.name for m, c in zip(problem.mfcs, moves.cands) if not c]
        raise ValueError(f"MFCs without candidates: {empty}")
    top = _Top(top_k)
    starts = list(initial) + [_greedy_start(problem)]
    scored = []
    for plan in starts:
        ev = evaluate(problem, plan)
        top.add(plan, ev)
        scored.append((ev.cost, plan, ev))
    _, current, cur_ev = min(scored, key=lambda x: x[0])
    best, best_ev = current, cur_ev
    cache: dict[Plan, PlanEvaluation] = {}
    steps, improved_at = 0, 0
    stopped_by: StoppedBy = "steps"
    while steps < max_steps:
        if steps % 64 == 0 and time.perf_counter() - started > budget:
            stopped_by = "time"
            break
        if steps - improved_at >= patience:
            stopped_by = "converged"
            break
        phase = (steps % CYCLE_STEPS) / CYCLE_STEPS
        if steps % CYCLE_STEPS == 0 and steps:
            current, cur_ev = best, best_ev  # restart the cooling from the best plan
        temperature = START_TEMPERATURE * (END_TEMPERATURE / START_TEMPERATURE) ** phase
        proposal = moves.propose(current, rng)
        if proposal in cache:
            ev = cache[proposal]
        else:
            ev = evaluate(problem, proposal)
            if len(cache) < 200000:
                cache[proposal] = ev
            top.add(proposal, ev)
        steps += 1
        delta = (ev.cost - cur_ev.cost) / max(cur_ev.cost, 1e-12)
        if delta <= 0 or rng.random() < math.exp(-delta / temperature):
            current, cur_ev = proposal, ev
            if ev.cost < best_ev.cost * (1 - 1e-9):
                best, best_ev, improved_at = proposal, ev, steps
    best, best_ev = _polish(problem, best, best_ev, moves, top, started, budget)
    return SearchResult(best, best_ev, top.sorted(), "anneal", steps, time.perf_counter() - started, stopped_by)


def _polish(problem: PlanProblem, plan: Plan, ev: PlanEvaluation, moves: _Moves, top: _Top, started: float,
            budget: float) -> tuple[Plan, PlanEvaluation]:
    """Coordinate descent: give each MFC in turn its best candidate while the others stay."""
    improved = True
    while improved and time.perf_counter() - started < budget:
        improved = False
        for i in range(len(plan)):
            for cand in moves.cands[i]:
                trial = plan[:i] + (cand,) + plan[i + 1:]
                trial_ev = evaluate(problem, trial)
                top.add(trial, trial_ev)
                if trial_ev.cost < ev.cost * (1 - 1e-9):
                    plan, ev, improved = trial, trial_ev, True
    return plan, ev
