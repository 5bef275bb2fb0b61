"""The timeline of one iteration: when each MFC, reallocation and data transfer runs.

``simulate`` is a list scheduler over tasks given in schedule order, which is how the SPMD
runtime behaves: every rank walks the same step list, so a task starts once all of its ranks
have finished their earlier tasks and its inputs have arrived. Tasks on disjoint rank sets run
side by side; tasks sharing a rank run one after the other in schedule order.

``plan_steps`` turns a plan into the ordered steps the schedule lists (reallocate, transfer,
run, free) and ``plan_tasks`` into the tasks of one iteration. By default an iteration starts
after the previous one has finished on every rank (the runtime closes an iteration with the
master's statistics gather), so the steady-state iteration time is one iteration's makespan.
With ``overlap=True`` iterations may overlap where parameter versions allow: an MFC of
iteration k+1 waits for its model's train step of iteration k, and the steady-state time is the
period between iterations' ends. Within an iteration:

* an MFC waits for the MFCs producing its inputs, plus the time to move those inputs when
  producer and consumer layouts differ;
* parameter versions: a train step waits for every earlier MFC of its model (they must read
  the parameters before the update); a reallocated copy is made from the home layout right
  before the MFC that needs it (after the home's train step, if that comes earlier);
* a reallocation occupies the ranks of both its source and destination meshes; a copy is kept
  for the next MFC of the same model when that one runs on the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from restage.plan.transfer import data_transfer_seconds, key_bytes, zero3_gather_seconds


@dataclass(frozen=True)
class Task:
    """One step of the iteration: ``seconds`` on ``ranks`` after each (task, delay seconds) in ``after``."""

    name: str
    ranks: tuple[int, ...]
    seconds: float
    after: tuple[tuple[str, float], ...] = ()
    kind: str = "mfc"  # mfc or realloc


@dataclass(frozen=True)
class Step:
    """One entry of the schedule's step list: ``realloc`` / ``free`` a parameter copy, ``transfer`` a key, run an ``mfc``."""

    kind: str
    mfc: str  # the MFC the step serves (runs before it; ``free`` runs after it)
    model: str = ""
    key: str = ""
    source: str = ""  # transfer: the producing MFC
    nbytes: int = 0  # transfer: bytes of the key for the whole batch


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


def realloc_name(mfc_name: str) -> str:
    return f"realloc:{mfc_name}"


def needs_copy(problem, plan, mfc) -> bool:
    """Whether ``mfc`` runs on a copy of its model's parameters made from the home layout."""
    if problem.is_home(mfc):
        return False
    home = plan[problem.index[problem.home[mfc.model]]]
    role = problem.role(mfc)
    return plan[problem.index[mfc.name]].layout != home.layout or (role.trainable and role.zero_stage == 3)


def copy_seconds(problem, plan, mfc) -> float:
    """Seconds to make the copy ``mfc`` runs on: reallocation, plus a ZeRO-3 gather out of training."""
    home = plan[problem.index[problem.home[mfc.model]]].layout
    dst = plan[problem.index[mfc.name]].layout
    role = problem.role(mfc)
    seconds = 0.0 if dst == home else problem.realloc(mfc.model, home, dst).seconds
    if role.trainable and role.zero_stage == 3:
        seconds += zero3_gather_seconds(role.arch, home, role.bytes_per_element, problem.cluster)
    return seconds


def plan_steps(problem, plan) -> list[Step]:
    """The iteration's steps in execution order."""
    steps: list[Step] = []
    live: dict[str, object] = {}  # model -> layout of its live copy
    for i, (mfc, cand) in enumerate(zip(problem.mfcs, plan)):
        if needs_copy(problem, plan, mfc) and live.get(mfc.model) != cand.layout:
            steps.append(Step("realloc", mfc.name, model=mfc.model))
            live[mfc.model] = cand.layout
        for key in mfc.inputs:
            producer = problem.graph.producer(key)
            if producer is not None and plan[problem.index[producer.name]].layout != cand.layout:
                steps.append(Step("transfer", mfc.name, model=mfc.model, key=key, source=producer.name,
                                  nbytes=key_bytes(mfc, key)))
        steps.append(Step("mfc", mfc.name, model=mfc.model))
        if mfc.model in live:
            following = next((j for j in range(i + 1, len(plan)) if problem.mfcs[j].model == mfc.model), None)
            keep = following is not None and needs_copy(problem, plan, problem.mfcs[following]) \
                and plan[following].layout == live[mfc.model]
            if not keep:
                steps.append(Step("free", mfc.name, model=mfc.model))
                del live[mfc.model]
    return steps


def plan_tasks(problem, plan, steps: list[Step] | None = None) -> list[Task]:
    """The tasks of one iteration of ``plan`` (one candidate per MFC, in graph order)."""
    steps = plan_steps(problem, plan) if steps is None else steps
    tasks = []
    done: list = []
    copy_task: dict[str, str] = {}  # model -> the realloc task its live copy came from
    delays: dict[str, dict[str, int]] = {}
    for step in steps:
        if step.kind == "transfer":
            delays.setdefault(step.mfc, {}).setdefault(step.source, 0)
            delays[step.mfc][step.source] += step.nbytes
    for step in steps:
        if step.kind == "realloc":
            mfc = problem.graph[step.mfc]
            home_name = problem.home[mfc.model]
            home = plan[problem.index[home_name]].layout
            dst = plan[problem.index[mfc.name]].layout
            ranks = tuple(sorted(set(home.mesh) | set(dst.mesh)))
            source_ready = ((home_name, 0.0),) if any(m.name == home_name for m in done) else ()
            tasks.append(Task(realloc_name(mfc.name), ranks, copy_seconds(problem, plan, mfc), source_ready, "realloc"))
            copy_task[mfc.model] = realloc_name(mfc.name)
        elif step.kind == "mfc":
            mfc = problem.graph[step.mfc]
            cand = plan[problem.index[mfc.name]]
            after = []
            for parent in problem.graph.parents(mfc.name):
                nbytes = delays.get(mfc.name, {}).get(parent.name, 0)
                seconds = data_transfer_seconds(plan[problem.index[parent.name]].layout, cand.layout, nbytes,
                                                problem.cluster) if nbytes else 0.0
                after.append((parent.name, seconds))
            if mfc.kind == "train_step":
                after += [(m.name, 0.0) for m in done if m.model == mfc.model]
            if needs_copy(problem, plan, mfc):
                after.append((copy_task[mfc.model], 0.0))
            tasks.append(Task(mfc.name, cand.layout.mesh, cand.seconds, tuple(after)))
            done.append(mfc)
    return tasks


def steady_state(problem, plan, overlap: bool = False, iterations: int = 4) -> tuple[float, Timeline]:
    """(steady-state seconds per iteration, the timeline of one iteration)."""
    tasks = plan_tasks(problem, plan)
    first = simulate(tasks)
    if not overlap:
        return first.makespan_seconds, first
    trains = {m.model: m.name for m in problem.mfcs if m.kind == "train_step"}
    model_of = {t.name: (problem.graph[t.name].model if t.kind == "mfc" else
                         problem.graph[t.name.split(":", 1)[1]].model) for t in tasks}
    unrolled = []
    for k in range(iterations):
        for t in tasks:
            after = [(f"{name}#{k}", delay) for name, delay in t.after]
            model = model_of[t.name]
            if k and model in trains:  # parameter version: wait for the previous iteration's update
                after.append((f"{trains[model]}#{k - 1}", 0.0))
            unrolled.append(Task(f"{t.name}#{k}", t.ranks, t.seconds, tuple(after), t.kind))
    timeline = simulate(unrolled)
    ends = [max(s.end_seconds for s in timeline.spans if s.name.endswith(f"#{k}")) for k in range(iterations)]
    return ends[-1] - ends[-2], first
