"""``build_schedule``: a chosen plan written down as the schedule (``restage.schedule.file``) the runtime executes."""

from __future__ import annotations

from dataclasses import replace
from typing import assert_never

from restage.plan.plan_score import evaluate
from restage.plan.simulator import op_name, plan_ops
from restage.plan.transfer_cost import key_bytes
from restage.schedule.file import SCHEDULE_FORMAT_VERSION, MFCEntry, ModelEntry, Schedule, Step
from restage.schedule.ops import Ema, Free, Generate, Offload, Op, Push, Realloc, Reload, Run, SendKey, TakeBuffered


def build_schedule(cfg, outcome, exact: bool = True) -> Schedule:
    """The schedule of ``outcome`` (a planner.PlanOutcome); ``exact`` takes reallocation bytes from the runtime's planner."""
    problem, plan = outcome.problem, outcome.plan
    cfg = outcome.config if outcome.config is not None else cfg  # plan.execution auto: the chosen mode's config
    problem.exact_realloc = exact
    ev = evaluate(problem, plan)
    spans = {s.name: s for s in ev.timeline.spans}
    cluster = problem.cluster
    models = {}
    for name, role in problem.roles.items():
        if name not in problem.home:
            continue
        home = plan[problem.index[problem.home[name]]]
        models[name] = ModelEntry(role.arch, role.path, role.preset, role.trainable, role.dtype, role.zero_stage,
                                  role.gradient_checkpointing, role.offload_optimizer, role.offload_params,
                                  role.offload_when_idle, problem.home[name], home.layout,
                                  shard_frozen=role.shard_frozen and not role.trainable)
    mfcs = []
    for i, (mfc, cand) in enumerate(zip(problem.mfcs, plan)):
        span = spans[mfc.name]
        predicted = {"seconds": cand.seconds, "peak_memory_bytes": ev.mfc_peak_memory_bytes[i],
                     "start_seconds": span.start_seconds, "end_seconds": span.end_seconds,
                     "source": cand.estimate.source, "breakdown": dict(cand.estimate.breakdown)}
        mfcs.append(MFCEntry(replace(mfc, micro_batches=cand.micro_batches), cand.layout, predicted))
    steps = []
    for i, op in enumerate(plan_ops(problem, plan)):
        timed = None
        if not isinstance(op, Free):  # a free takes no time: the timeline has no span for it
            span = spans[op_name(op, i)]
            timed = {"seconds": span.end_seconds - span.start_seconds, "start_seconds": span.start_seconds,
                     "end_seconds": span.end_seconds}
        steps.append(Step(op, timed, _moved_bytes(problem, op)))
    flops = problem.iteration_flops()
    predicted = {"iteration_seconds": ev.iteration_seconds, "samples_per_iteration": problem.samples_per_iteration,
                 "samples_per_second": problem.samples_per_iteration / ev.iteration_seconds,
                 "flops_per_iteration": flops, "pflops_per_second": flops / ev.iteration_seconds / 1e15,
                 "peak_memory_bytes": ev.peak_memory_bytes, "usable_memory_bytes": problem.capacity_bytes,
                 "estimator": sorted({c.estimate.source for c in plan}),
                 "iteration_overlap": problem.overlap_iterations}
    info = {"mode": outcome.mode, "seed": cfg.seed,
            "baselines": {name: (None if b is None else {"iteration_seconds": b.iteration_seconds,
                                                         "peak_memory_bytes": b.peak_memory_bytes})
                          for name, b in outcome.baselines.items()}}
    if outcome.mode_choice is not None:
        info["execution"] = outcome.mode_choice.to_json()
    if outcome.search is not None:
        s = outcome.search
        info["search"] = {"method": s.method, "steps": s.steps, "wall_seconds": s.wall_seconds, "stopped_by": s.stopped_by,
                          "top_iteration_seconds": [e.iteration_seconds for _, e in s.top]}
    return Schedule(SCHEDULE_FORMAT_VERSION, cfg.experiment, cfg.trial, cfg.to_dict(), cluster.to_json(), cluster.world_size,
                    models, tuple(mfcs), tuple(steps), predicted, info)


def _moved_bytes(problem, op: Op) -> int | None:
    """Bytes a reallocation, EMA or key transfer sends (the planner's count); None for ops that send nothing."""
    match op:
        case Realloc() | Push():
            return problem.realloc(op.model, op.src, op.dst).total_bytes
        case Ema():
            return problem.realloc(problem.graph[op.mfc].model, op.src, op.dst).total_bytes
        case SendKey():
            return key_bytes(problem.graph[op.mfc], op.key)
        case Run() | Free() | Offload() | Reload() | Generate() | TakeBuffered():
            return None
        case _:
            assert_never(op)
