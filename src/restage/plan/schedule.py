"""``build_schedule``: a chosen plan written down as the schedule (``restage.schedule.file``) the runtime executes."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import assert_never

from restage.config.choices import Execution as ExecutionSetting
from restage.config.schema import ExperimentConfig
from restage.plan.plan_score import evaluate
from restage.plan.planner import PlanOutcome, with_execution
from restage.plan.problem import Candidate, PlanProblem
from restage.plan.roles import ModelRole
from restage.plan.simulator import op_name, plan_ops
from restage.plan.transfer_cost import key_bytes
from restage.schedule.file import SCHEDULE_FORMAT_VERSION, MFCEntry, Schedule, Step
from restage.schedule.model_entry import ModelEntry, runs_with_value_head
from restage.schedule.ops import Ema, Free, Generate, Offload, Op, Push, Realloc, Reload, Run, SendKey, TakeBuffered
from restage.schedule.predictions import (
    BaselinePrediction,
    IterationPrediction,
    MFCPrediction,
    PlanFacts,
    SearchFacts,
    SpanPrediction,
)


def build_schedule(cfg: ExperimentConfig, outcome: PlanOutcome, exact: bool = True) -> Schedule:
    """The schedule of ``outcome``; ``exact`` takes reallocation bytes from the runtime's planner."""
    problem, plan = outcome.problem, outcome.plan
    execution = outcome.execution
    if cfg.plan.execution == ExecutionSetting.AUTO:  # the algorithms read the chosen mode from the config they run
        cfg = with_execution(cfg, execution)
    problem.exact_realloc = exact
    ev = evaluate(problem, plan)
    spans = {s.name: s for s in ev.timeline.spans}
    cluster = problem.cluster
    models = {name: model_entry(cfg, problem, name, plan[problem.index[problem.home[name]]]) for name in problem.roles
              if name in problem.home}
    mfcs = []
    for i, (mfc, cand) in enumerate(zip(problem.mfcs, plan, strict=True)):
        span = spans[mfc.name]
        mfc_predicted = MFCPrediction(cand.seconds, ev.mfc_peak_memory_bytes[i], span.start_seconds, span.end_seconds,
                                  cand.estimate.source, dict(cand.estimate.breakdown))
        mfcs.append(MFCEntry(replace(mfc, micro_batches=cand.micro_batches), cand.layout, mfc_predicted))
    steps = []
    for i, op in enumerate(plan_ops(problem, plan)):
        timed = None
        if not isinstance(op, Free):  # a free takes no time: the timeline has no span for it
            span = spans[op_name(op, i)]
            timed = SpanPrediction(span.end_seconds - span.start_seconds, span.start_seconds, span.end_seconds)
        steps.append(Step(op, timed, _moved_bytes(problem, op)))
    flops = problem.iteration_flops()
    predicted = IterationPrediction(ev.iteration_seconds, problem.samples_per_iteration,
                                    problem.samples_per_iteration / ev.iteration_seconds, flops,
                                    flops / ev.iteration_seconds / 1e15, ev.peak_memory_bytes, problem.capacity_bytes,
                                    tuple(sorted({c.estimate.source for c in plan})), problem.overlap_iterations)
    baselines = {name: (None if b is None else BaselinePrediction(b.iteration_seconds, b.peak_memory_bytes))
                 for name, b in outcome.baselines.items()}
    search = None
    if outcome.search is not None:
        s = outcome.search
        search = SearchFacts(s.method, s.steps, s.wall_seconds, s.stopped_by,
                             tuple(e.iteration_seconds for _, e in s.top))
    info = PlanFacts(outcome.mode, cfg.seed, baselines, outcome.mode_choice, search)
    return Schedule(SCHEDULE_FORMAT_VERSION, cfg.experiment, cfg.trial, cfg.to_dict(), cluster, cluster.world_size,
                    execution, models, tuple(mfcs), tuple(steps), predicted, info)


# The fields a ModelEntry takes from the planner's ModelRole as they are.
_ROLE_FIELDS = tuple(sorted({f.name for f in fields(ModelEntry)} & {f.name for f in fields(ModelRole)} - {"shard_frozen"}))


def model_entry(cfg: ExperimentConfig, problem: PlanProblem, name: str, home: Candidate) -> ModelEntry:
    """Model ``name`` as the run holds it: its planning role, its home candidate's layout and the settings of
    ``models.<name>`` the planner does not use (optimizer, router loss weight)."""
    role, spec = problem.roles[name], cfg.models[name]
    return ModelEntry(**{f: getattr(role, f) for f in _ROLE_FIELDS}, home_mfc=problem.home[name],
                      home_layout=home.layout, shard_frozen=role.shard_frozen and not role.trainable,
                      critic=runs_with_value_head(name, role.arch, spec.init_critic_from_lm),
                      optim=spec.optim, router_aux_loss_coef=spec.router_aux_loss_coef)


def _moved_bytes(problem: PlanProblem, op: Op) -> int | None:
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
