"""The timeline of one iteration: when each MFC, reallocation and data transfer runs.

``simulate`` is a list scheduler over tasks given in program order, which is how the SPMD
runtime behaves: every rank walks the same op list and performs the ops it is part of, so an
op starts once all of its ranks have finished their earlier ops. Ops on disjoint rank sets run
side by side; ops sharing a rank run one after the other. Data and parameter-version
dependencies follow from that: a transfer involves its producer's ranks (so it waits for the
producer), the consumer's ranks (so the consumer waits for it), and a reallocation involves its
model's home ranks (so it reads the parameters between train steps, never during one).

``plan_ops`` holds the ops of the runtime's program (``schedule.program.build_program``) for the
plan's layouts, reordered so that MFCs on disjoint meshes can overlap. In the runtime's own
order a transfer sits right before its consumer and blocks its producer's ranks until the
consumer's turn comes (a rank busy with an unrelated MFC then holds everyone up). Here the ops
are sorted by their start in a relaxed timeline where transfers cost only a delay: runs and
reallocations at their relaxed start, each transfer at the moment both its producer has
finished and its consumer's ranks are free. The schedule lists ops in this order; the runtime
walks them.

By default an iteration starts after the previous one has finished on every rank (the master
closes each iteration), so the steady-state iteration time is one iteration's makespan. With
``overlap=True`` consecutive iterations' op lists are simply concatenated (no barrier), and the
steady-state time is the period between iterations' ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, assert_never

from restage.graph import MFC, MFCKind
from restage.layout import Layout
from restage.models.sharding import stage_layers
from restage.plan.generation_cost import RestageEngine
from restage.plan.problem import AsyncExecution, Candidate, Plan, PlanProblem
from restage.plan.rollout_cost import lockstep_forwards
from restage.plan.transfer_cost import key_bytes, zero3_gather_seconds
from restage.rollout.budget import gathers_once
from restage.schedule.async_program import async_layout_problem, build_async_program, lookahead, producers
from restage.schedule.ops import (
    Ema,
    Free,
    Generate,
    Offload,
    Op,
    Push,
    Realloc,
    Reload,
    Run,
    SendKey,
    TakeBuffered,
    op_subject,
)
from restage.schedule.program import build_program

# How a generation in place on its ZeRO-3 training layout runs (``zero3_generation_mode``).
Zero3GenerationMode = Literal["gather_once", "lockstep"]


@dataclass(frozen=True)
class Task:
    """One step of the iteration: ``seconds`` on ``ranks`` after each (task, delay seconds) in ``after``."""

    name: str
    ranks: tuple[int, ...]
    seconds: float
    after: tuple[tuple[str, float], ...] = ()
    kind: str = "run"  # the ``kind`` of the op it times (restage.schedule.ops)


@dataclass(frozen=True)
class Span:
    name: str
    kind: str
    ranks: tuple[int, ...]
    start_seconds: float
    end_seconds: float


@dataclass(frozen=True)
class Timeline:
    spans: tuple[Span, ...]

    @property
    def makespan_seconds(self) -> float:
        return max((s.end_seconds for s in self.spans), default=0.0)

    def __getitem__(self, name: str) -> Span:
        for span in self.spans:
            if span.name == name:
                return span
        raise KeyError(name)


def simulate(tasks: Sequence[Task]) -> Timeline:
    """Start every task as early as its dependencies and its ranks allow, in the given order."""
    free: dict[int, float] = {}
    end: dict[str, float] = {}
    spans = []
    for task in tasks:
        ready = max((end[name] + delay for name, delay in task.after), default=0.0)
        start = max(ready, max((free.get(r, 0.0) for r in task.ranks), default=0.0))
        finish = start + task.seconds
        for r in task.ranks:
            free[r] = finish
        end[task.name] = finish
        spans.append(Span(task.name, task.kind, task.ranks, start, finish))
    return Timeline(tuple(spans))


def plan_layouts(problem: PlanProblem, plan: Plan) -> dict[str, Layout]:
    return {m.name: c.layout for m, c in zip(problem.mfcs, plan)}


def plan_ops(problem: PlanProblem, plan: Plan) -> list[Op]:
    """The runtime's ops for ``plan``, ordered by a relaxed timeline (see the module docstring)."""
    return [op for op, _ in plan_program(problem, plan)]


def plan_program(problem: PlanProblem, plan: Plan) -> list[tuple[Op, float]]:
    """(op, predicted seconds) in the order of ``plan_ops``.

    Sort keys: (relaxed start, rank of the kind at one start, list index); a transfer's start is
    placed once its consumer's ranks are known to be free, a free or offload goes right after the op before it."""
    offload = frozenset(name for name, role in problem.roles.items() if role.offload_when_idle and not role.trainable)
    resident = frozenset(name for name, role in problem.roles.items() if role.arch.lora is not None)
    if problem.execution is not None:  # async: the builder's order is the one that overlaps (schedule/async_program.py)
        ex = problem.execution
        ops = build_async_program(problem.graph, plan_layouts(problem, plan), ex.staleness, ex.push_every,
                                  offload_idle=offload, resident=resident, partial=ex.partial)
        return [(op, op_seconds(problem, plan, op)) for op in ops]
    ops = build_program(problem.graph, plan_layouts(problem, plan), offload_idle=offload, resident=resident)
    free: dict[int, float] = {}
    run_end: dict[str, float] = {}
    arrived: dict[str, float] = {}  # MFC -> when its last input lands
    ranks_free: dict[str, float] = {}  # MFC -> when the ranks of its first op (realloc or run) are free
    keys: list[tuple[float, int, int] | None] = []  # sort keys (start, order, index); None: a transfer not yet placed
    seconds = [op_seconds(problem, plan, op) for op in ops]

    def start_at(i: int, op: Op, consumer: str, order: int, run: str = "") -> None:
        start = max((free.get(r, 0.0) for r in op.ranks), default=0.0)
        ranks_free.setdefault(consumer, start)
        if run:
            start = max(start, arrived.get(run, 0.0))
        end = start + seconds[i]
        for r in op.ranks:
            free[r] = end
        if run:
            run_end[run] = end
        keys.append((start, order, i))

    def next_run(i: int, model: str) -> str:
        return next((o.mfc for o in ops[i:] if isinstance(o, Run) and o.model == model), "")

    for i, op in enumerate(ops):
        match op:
            case SendKey():
                arrived[op.mfc] = max(arrived.get(op.mfc, 0.0), run_end[op.producer] + seconds[i])
                keys.append(None)  # placed below, once its consumer's ranks are known to be free
            case Free() | Offload():
                keys.append(keys[-1][:2] + (i,) if keys and keys[-1] else (0.0, 9, i))  # right after the op before it
            case Reload():
                start_at(i, op, next_run(i, op.model), 1)
            case Realloc():
                start_at(i, op, next_run(i, op.model), 2)
            case Run():
                start_at(i, op, op.mfc, 3, run=op.mfc)
            case Ema():
                start_at(i, op, op.mfc, 4)
            case Push() | Generate() | TakeBuffered():
                raise AssertionError(f"{op.kind}: async mode's program is not reordered")
            case _:
                assert_never(op)
    for i, op in enumerate(ops):
        if isinstance(op, SendKey):  # when both its producer has finished and its consumer's ranks are free
            keys[i] = (max(run_end[op.producer], ranks_free.get(op.mfc, 0.0)), 0, i)
    placed = [key for key in keys if key is not None]
    assert len(placed) == len(keys)  # every transfer was placed above
    order = sorted(range(len(ops)), key=lambda i: placed[i])
    return [(ops[i], seconds[i]) for i in order]


def copy_seconds(problem: PlanProblem, src: Layout, dst: Layout, model: str) -> float:
    """Seconds to reallocate ``model`` from ``src`` to ``dst``, plus a ZeRO-3 gather out of its training engine."""
    role = problem.roles[model]
    seconds = 0.0 if src == dst else problem.realloc(model, src, dst).seconds
    if role.trainable and role.zero_stage == 3 and role.arch.lora is None:  # LoRA: only the adapters are gathered
        seconds += zero3_gather_seconds(role.arch, src, role.bytes_per_element, problem.cluster)
    return seconds


def op_seconds(problem: PlanProblem, plan: Plan, op: Op) -> float:
    """Predicted seconds of one op."""
    match op:
        case Run():
            mfc = problem.graph[op.mfc]
            cand = plan[problem.index[op.mfc]]
            return zero3_in_place_seconds(problem, plan, mfc) if zero3_in_place(problem, plan, mfc) else cand.seconds
        case Realloc():
            return copy_seconds(problem, op.src, op.dst, op.model) + problem.cluster.realloc_overhead_seconds
        case Ema():  # the trained model reallocated into the reference's home (mixing in is one pass over it)
            return (copy_seconds(problem, op.src, op.dst, problem.graph[op.mfc].model)
                    + problem.cluster.realloc_overhead_seconds)
        case SendKey():
            if op.src == op.dst:
                return 0.0
            return (problem.data_transfer(op.src, op.dst, key_bytes(problem.graph[op.mfc], op.key))
                    + problem.cluster.transfer_overhead_seconds)
        case Offload() | Reload():
            cand = plan[problem.index[problem.home[op.model]]]
            return cand.estimate.param_bytes / problem.cluster.host_bandwidth_bytes_per_second
        case Push():  # every push_every steps: its cost spread over them
            return (copy_seconds(problem, op.src, op.dst, op.model) + problem.cluster.realloc_overhead_seconds) / op.every
        case Generate():  # the steady state generates one batch a step; the warm-up's are costed by steady_state
            if op.start == 0:
                return 0.0
            candidate = plan[problem.index[op.mfc]]
            return candidate.seconds + (refill_seconds(problem.graph[op.mfc], candidate) if op.partial else 0.0)
        case TakeBuffered() | Free():
            return 0.0
        case _:
            assert_never(op)


def op_name(op: Op, index: int) -> str:
    """The op's span name in the timeline: an MFC's name for a run, else kind, what it serves, and key or index."""
    if isinstance(op, Run) or (isinstance(op, Generate) and op.start > 0):  # async: a producer's span is its step's
        return op.mfc
    what = op_subject(op)
    return f"{op.kind}:{what}:{op.key}" if isinstance(op, SendKey) else f"{op.kind}:{what}:{index}"


def plan_tasks(problem: PlanProblem, plan: Plan) -> list[Task]:
    """One task per op of one iteration (dependencies are the ranks each op shares with earlier ones)."""
    return [Task(op_name(op, i), op.ranks, seconds, (), op.kind)
            for i, (op, seconds) in enumerate(plan_program(problem, plan)) if not isinstance(op, Free)]


def needs_copy(problem: PlanProblem, plan: Plan, mfc: MFC) -> bool:
    """Whether ``mfc`` runs on a reallocated copy of its model (a layout other than the model's home)."""
    home = plan[problem.index[problem.home[mfc.model]]]
    return plan[problem.index[mfc.name]].layout != home.layout


def zero3_in_place(problem: PlanProblem, plan: Plan, mfc: MFC) -> bool:
    """A generate / inference MFC on its ZeRO-3 model's training layout, whose parameters it must gather."""
    role = problem.role(mfc)
    return (mfc.kind is not MFCKind.TRAIN_STEP and role.trainable and role.zero_stage == 3 and not problem.is_home(mfc)
            and not needs_copy(problem, plan, mfc))


def zero3_generation_mode(problem: PlanProblem, plan: Plan, mfc: MFC) -> Zero3GenerationMode:
    """How a generation in place (``zero3_in_place``) runs: the runtime's rule (``runtime/store/zero3_generation.py``,
    ``rollout.budget.gathers_once``) on the planner's figures. Gathered once when the stage's parameters fit
    ``GATHER_ONCE_FRACTION`` of what its ranks have left (usable memory less the persistent state of the models
    whose homes hold them, the most on any of its ranks); else lockstep. The peers' engines and engines other than
    restage's rollout engine gather once (``PlanProblem.zero3_lockstep``)."""
    cand = plan[problem.index[mfc.name]]
    if not problem.zero3_lockstep or not isinstance(problem.estimator.engine, RestageEngine):
        return "gather_once"
    held = max(_home_state_bytes(problem, plan, rank) for rank in cand.layout.mesh)
    return "gather_once" if gathers_once(cand.estimate.param_bytes, problem.capacity_bytes - held) else "lockstep"


def _home_state_bytes(problem: PlanProblem, plan: Plan, rank: int) -> int:
    """Bytes the models whose homes hold ``rank`` keep there all along (``evaluate.plan_memory``'s persistent state)."""
    return sum(home.estimate.state_bytes for model, home in ((m, plan[problem.index[h]]) for m, h in problem.home.items())
               if rank in home.layout.mesh and (problem.roles[model].trainable or not problem.roles[model].offload_when_idle))


def zero3_in_place_seconds(problem: PlanProblem, plan: Plan, mfc: MFC) -> float:
    """Seconds of an MFC in place (``zero3_in_place``), its ZeRO-3 gathers over the dp group included.

    A generation gathered once runs on a plain copy, costed as any copy (CUDA graphs where they serve), plus one
    gather of the stage; in lockstep it decodes eagerly over the partitions (``PlanProblem.in_place_seconds``) and
    gathers the stage in each forward, ``rollout_cost.lockstep_forwards`` of them (decode steps, and a prefill or an
    empty join per check; the estimator gives every answer one length, so the extra joins uneven answers bring
    are not counted). An inference keeps one gather per call (as before)."""
    cand = plan[problem.index[mfc.name]]
    role = problem.role(mfc)
    gather = zero3_gather_seconds(role.arch, cand.layout, role.bytes_per_element, problem.cluster)
    if mfc.kind is not MFCKind.GENERATE:
        return cand.seconds + gather
    mode = zero3_generation_mode(problem, plan, mfc)
    match mode:
        case "gather_once":
            return cand.seconds + gather
        case "lockstep":
            engine = problem.estimator.engine
            assert isinstance(engine, RestageEngine)  # zero3_generation_mode: other engines gather once
            forwards = lockstep_forwards(problem.cluster, engine, mfc, role, cand.layout)
            return problem.in_place_seconds(cand) + forwards * gather
        case _:
            assert_never(mode)


def zero3_in_place_bytes(problem: PlanProblem, plan: Plan, mfc: MFC) -> int:
    """Bytes an MFC in place (``zero3_in_place``) gathers on top of its partition: the stage's parameters, or in
    lockstep about one layer's (DeepSpeed's hooks hold a module's parameters while it runs)."""
    param_bytes = plan[problem.index[mfc.name]].estimate.param_bytes
    if mfc.kind is not MFCKind.GENERATE:
        return param_bytes
    mode = zero3_generation_mode(problem, plan, mfc)
    match mode:
        case "gather_once":
            return param_bytes
        case "lockstep":
            layers = max(hi - lo for lo, hi in stage_layers(problem.role(mfc).arch,
                                                            plan[problem.index[mfc.name]].layout.strategy.pp))
            return param_bytes // max(1, layers)
        case _:
            assert_never(mode)


def steady_state(problem: PlanProblem, plan: Plan, overlap: bool = False, iterations: int = 3) -> tuple[float, Timeline]:
    """(steady-state seconds per iteration, the timeline of one iteration).

    Async mode (``problem.execution``): one iteration of its program, where the producers generate the next
    batches while the consumers train (the slower side sets the period), plus the weight push (spread over
    ``push_every`` steps), plus the warm-up (the first ``ahead`` batches, generated before any training) spread
    over the run's steps. Layouts async mode cannot run (generation sharing the trained model's ranks) cost
    infinity."""
    if problem.execution is not None:
        return _async_steady_state(problem, plan, problem.execution)
    tasks = plan_tasks(problem, plan)
    first = simulate(tasks)
    if not overlap:
        return first.makespan_seconds, first
    unrolled = [Task(f"{t.name}#{k}", t.ranks, t.seconds, (), t.kind) for k in range(iterations) for t in tasks]
    timeline = simulate(unrolled)
    ends = [max(s.end_seconds for s in timeline.spans if s.name.endswith(f"#{k}")) for k in range(iterations)]
    return ends[-1] - ends[-2], first


def refill_seconds(mfc: MFC, candidate: Candidate) -> float:
    """Partial rollouts: the prefill again, under the weights of the step, of the answers the step before left in
    flight. Costed at its worst, every answer of the batch cut half-way (prompt + gen / 2 tokens each), scaled from
    the candidate's own prefill (``(prompt - 1)`` tokens once per group); the tiny GRPO job's 50-step run cuts
    about 40% of them (docs/runtime.md, "Partial rollouts"). The estimator gives every answer the same length, so the gain
    partial rollouts bring on uneven answers (the generator no longer waits for a batch's longest) is not costed."""
    group = mfc.options.group
    prefix = max(1, mfc.prompt_tokens - 1)
    return candidate.estimate.part("prefill_seconds") * group * (mfc.prompt_tokens + mfc.gen_tokens / 2) / prefix


def _async_steady_state(problem: PlanProblem, plan: Plan, ex: AsyncExecution) -> tuple[float, Timeline]:
    if async_layout_problem(problem.graph, plan_layouts(problem, plan)) is not None:
        return math.inf, Timeline(())
    timeline = simulate(plan_tasks(problem, plan))
    warmup_seconds = sum(plan[problem.index[gen.name]].seconds for gen in producers(problem.graph))
    warmup_seconds *= lookahead(ex.staleness, ex.push_every, ex.partial)
    return timeline.makespan_seconds + warmup_seconds / ex.steps, timeline
