"""Async mode in planning: the best asynchronous plan of a problem, and the choice between modes.

``best_async_plan`` covers the split: generation (the trained actor's generate MFCs) on the last ``g`` ranks,
every other MFC on the first ``W - g`` (each mesh one that ``problem.mesh_options`` offers), and on each side every
MFC's fastest strategy there, with ``evaluate.fit_plan`` choosing micro-batches that fit. Its steady state is
``simulator.steady_state``'s (the slower of generation and training, plus the transfers, the weight push spread
over ``push_every`` steps, and the warm-up spread over the run). ``STALENESS_CHOICES`` x every ``push_every`` is
the grid ``plan.execution: auto`` searches beside the synchronous plan (``planner.make_plan``).
"""

from __future__ import annotations

from restage.layout import Layout
from restage.plan.plan_score import PlanEvaluation, fit_plan
from restage.plan.problem import Plan, PlanProblem, mesh_options, strategies_for
from restage.schedule.async_program import producers
from restage.schedule.predictions import ModeChoice

__all__ = ["STALENESS_CHOICES", "ModeChoice", "best_async_plan", "splits"]

# The staleness bounds plan.execution: auto tries (each with every push_every from 1 to it). Larger bounds only
# lengthen the warm-up and spread the push thinner; the decoupled loss's correction grows with the gap.
STALENESS_CHOICES = (1, 2)


def splits(problem: PlanProblem) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """((start, size) of the training side, (start, size) of the generation side) for every split the meshes allow."""
    world = problem.cluster.world_size
    meshes = set(mesh_options(problem.cluster))
    return [((0, start), (start, size)) for start, size in sorted(meshes)
            if start > 0 and start + size == world and (0, start) in meshes]


def best_async_plan(problem: PlanProblem) -> tuple[Plan, PlanEvaluation] | None:
    """The fastest feasible async plan over every split (module docstring), or None when no split fits."""
    assert problem.execution is not None, "an async problem (plan.execution: async)"
    ahead = {gen.name for gen in producers(problem.graph)}
    best: tuple[Plan, PlanEvaluation] | None = None
    for train_side, gen_side in splits(problem):
        layouts: dict[str, Layout] = {}
        for mfc in problem.mfcs:
            start, size = gen_side if mfc.name in ahead else train_side
            options = [c for strategy in strategies_for(size, problem.role(mfc), mfc, problem.cluster)
                       for c in problem.options(mfc, Layout.contiguous(start, strategy)) if problem.fits_alone(c)]
            if not options:
                break
            layouts[mfc.name] = min(options, key=lambda c: c.seconds).layout
        else:
            found = fit_plan(problem, layouts)
            if found is not None and (best is None or found[1].iteration_seconds < best[1].iteration_seconds):
                best = found
    return best
