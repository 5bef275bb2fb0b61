"""From an experiment config to a chosen plan: ``plan.mode`` is search, heuristic (a baseline) or manual.

A config whose models cannot fit on the cluster in any layout is refused with one line giving
the memory the leanest plan needs per device and the smallest node count on which it fits.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from typing import assert_never

from restage.algorithms.interface import build_graph, unused_models
from restage.cluster import ClusterSpec, cluster_from_config
from restage.config.choices import Execution as ExecutionSetting
from restage.config.choices import PlanMode
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError, LayoutError, PlanError
from restage.graph import MFCKind
from restage.layout import Layout, Strategy
from restage.models.attention import flash_attn_with_kvcache
from restage.plan.async_plan import STALENESS_CHOICES, best_async_plan
from restage.plan.estimator import Estimator
from restage.plan.generation_cost import RestageEngine
from restage.plan.peers.baselines import all_baselines, all_references, baseline, rebased, starting_plans
from restage.plan.plan_score import PlanEvaluation, evaluate
from restage.plan.problem import (
    AsyncExecution,
    Candidate,
    Plan,
    PlanProblem,
    mesh_options,
    micro_batch_options,
    roles_from_config,
    runtime_refuses,
    strategies_for,
    untrainable,
)
from restage.plan.search import SearchResult, search
from restage.rollout.budget import RolloutLimits
from restage.rollout.paged_attention_triton import triton_installed
from restage.schedule.execution import Async, Execution, Sync
from restage.schedule.predictions import ModeChoice, PlanMethod
from restage.schedule.program import ema_targets

GIB = 2**30
Found = dict[str, tuple[Plan, PlanEvaluation] | None]  # the peers' plans and restricted searches, by name (None: none fits)
MAX_NODES_TRIED = 1024


@dataclass(frozen=True)
class PlanOutcome:
    problem: PlanProblem  # its ``execution`` is the mode the plan runs in (the chosen one under plan.execution auto)
    plan: Plan
    evaluation: PlanEvaluation
    mode: PlanMethod
    baselines: dict[str, PlanEvaluation | None]  # peers' default plans and restricted searches (baselines.LABELS)
    search: SearchResult | None = None
    mode_choice: ModeChoice | None = None  # plan.execution auto: the modes compared

    @property
    def execution(self) -> Execution:
        """How the plan's iterations run, as the schedule says it (``schedule/execution.py``)."""
        ex = self.problem.execution
        return Sync() if ex is None else Async(ex.staleness, ex.push_every, ex.partial)


def build_problem(cfg: ExperimentConfig, cluster: ClusterSpec | None = None, flash_attn: bool | None = None) -> PlanProblem:
    """The planning problem of ``cfg`` on ``cluster`` (default the config's); ``flash_attn`` as ``engine_of``'s."""
    graph = build_graph(cfg)
    for name, why in unused_models(cfg, graph).items():
        print(f"restage: models.{name} is unused, so not planned or loaded: {why}", file=sys.stderr, flush=True)
    cluster = cluster or cluster_from_config(cfg)
    execution = (AsyncExecution(cfg.plan.staleness, cfg.plan.push_every, cfg.run.steps, cfg.plan.partial_rollouts)
                 if cfg.plan.execution == ExecutionSetting.ASYNC else None)
    estimator = Estimator(cluster, engine=engine_of(cfg, flash_attn))
    return PlanProblem(graph, roles_from_config(cfg, graph), cluster, estimator=estimator,
                       samples_per_iteration=cfg.run.batch_size, execution=execution)


def engine_of(cfg: ExperimentConfig, flash_attn: bool | None = None, triton: bool | None = None) -> RestageEngine:
    """The rollout engine the config's ``generation`` settings build (``rollout.generation.generate``'s limits).
    ``flash_attn``: whether flash-attn is installed where the ranks run; None: as in this process, which plans on
    (or as) the ranks' machines (``launch/job.py`` plans inside the job), the runtime asking the same of its own
    (``models.attention.flash_attn_with_kvcache``). ``triton``: likewise for triton (the paged cache's kernel where
    flash-attn's does not serve), taken only where ``generation.kv_cache: paged`` asks for a paged cache (``auto``
    pages only where flash-attn serves), so other configs' estimates stay as they were."""
    gen = cfg.generation
    flash = flash_attn_with_kvcache is not None if flash_attn is None else flash_attn
    limits = RolloutLimits.of_params(gen)  # kv_cache=auto stays None: the estimator decides as the engine does
    paged_triton = bool(limits.paged) and (triton_installed() if triton is None else triton)
    return RestageEngine(limits, cuda_graphs=gen.cuda_graphs, flash_attn=flash, triton=paged_triton)


def lean_plan(problem: PlanProblem) -> Plan | None:
    """Every MFC on the widest mesh it can use (the whole cluster unless its batch cannot fill that many DP
    ranks) with its least memory-hungry strategy: the plan most likely to fit."""
    sizes = sorted({size for start, size in mesh_options(problem.cluster) if start == 0}, reverse=True)
    plan = []
    for mfc in problem.mfcs:
        options: list[Candidate] = []
        for size in sizes:
            options = [problem.candidate(mfc, Layout.contiguous(0, s), m)
                       for s in strategies_for(size, problem.role(mfc), mfc, problem.cluster)
                       for m in micro_batch_options(mfc, s)[-2:]]
            if options:
                break
        if not options:
            return None
        plan.append(min(options, key=lambda c: (problem.alone_bytes(c), c.seconds)))
    return tuple(plan)


def check_placeable(problem: PlanProblem) -> None:
    """Raise PlanError (one line) naming an MFC that no mesh and strategy can run: its batch is too small for
    the DP ranks (per minibatch) any layout it may take has."""
    sizes = sorted({size for _, size in mesh_options(problem.cluster)})
    for mfc in problem.mfcs:
        role = problem.role(mfc)
        if any(strategies_for(size, role, mfc, problem.cluster) for size in sizes):
            continue
        if mfc.kind is MFCKind.TRAIN_STEP and mfc.n_seqs < mfc.minibatches:
            raise PlanError(f"{mfc.name}: its {mfc.n_seqs} sequences per step cannot fill {mfc.minibatches} "
                            "minibatches; raise run.batch_size or lower algo.minibatches")
        if mfc.kind is MFCKind.TRAIN_STEP and role.zero_stage == 3:
            raise PlanError(f"{mfc.name}: models.{mfc.model}: zero_stage=3 trains on all {problem.cluster.world_size} "
                            f"ranks, and its {mfc.n_seqs} sequences per step fill no DP size a layout over them has; "
                            "raise run.batch_size or use zero_stage 1 or 2")
        raise PlanError(f"{mfc.name}: no layout over any mesh of {problem.cluster.world_size} ranks fits its "
                        f"{mfc.n_seqs} sequences per step; raise run.batch_size")


def check_fits(problem: PlanProblem) -> None:
    """Raise PlanError (one line) when even the leanest plan does not fit; name the node count that would."""
    check_placeable(problem)
    plan = lean_plan(problem)
    ev = evaluate(problem, plan) if plan is not None else None
    if ev is not None and ev.feasible:
        return
    c = problem.cluster
    need = f"needs {ev.peak_memory_bytes / GIB:.1f} GiB on its fullest device" if ev else "has no layout"
    fits = None
    for nodes in range(c.nodes + 1, MAX_NODES_TRIED + 1):
        bigger = PlanProblem(problem.graph, problem.roles, c.with_size(nodes),
                             estimator=Estimator(c.with_size(nodes), engine=problem.estimator.engine),
                             samples_per_iteration=problem.samples_per_iteration, execution=problem.execution)
        lean = lean_plan(bigger)
        if lean is not None and evaluate(bigger, lean).feasible:
            fits = nodes
            break
    where = (f"it fits on {fits} nodes ({fits * c.devices_per_node} devices): set cluster.nodes={fits}" if fits
             else f"it does not fit on up to {MAX_NODES_TRIED} nodes; use smaller models or more memory per device")
    raise PlanError(f"{', '.join(sorted(problem.graph.models()))} do not fit on {c.nodes} node(s) x {c.devices_per_node} "
                    f"{c.name}: the leanest plan {need}, {c.usable_memory_bytes / GIB:.1f} GiB usable; {where}")


_MANUAL = re.compile(r"^\s*ranks:(?P<ranks>[\d,\-\s]+?)\s+(?P<strategy>(?:dp|tp|pp|ep)\d+(?:(?:dp|tp|pp|ep)\d+)*)"
                     r"(?:\s+mb(?P<mb>\d+))?\s*$")


def parse_manual_layout(text: str, where: str = "plan.layouts") -> tuple[Layout, int | None]:
    """``ranks:0-3 dp2tp2pp1 [mb4]`` (ranks as ranges and/or commas; ``dp4ep2`` splits experts) -> (layout,
    micro-batches or None)."""
    match = _MANUAL.match(text)
    if not match:
        raise ConfigError(f"{where}: cannot read {text!r}; write it like 'ranks:0-3 dp2tp2pp1' (optionally ' mb4')")
    ranks: list[int] = []
    for part in match["ranks"].replace(" ", "").split(","):
        lo, _, hi = part.partition("-")
        ranks += list(range(int(lo), int(hi or lo) + 1))
    try:
        layout = Layout(tuple(ranks), Strategy.parse(match["strategy"]))
    except LayoutError as err:
        raise ConfigError(f"{where}: {err}") from None
    return layout, int(match["mb"]) if match["mb"] else None


def manual_plan(cfg: ExperimentConfig, problem: PlanProblem) -> Plan:
    layouts = cfg.plan.layouts
    missing = [m.name for m in problem.mfcs if m.name not in layouts]
    unknown = sorted(set(layouts) - {m.name for m in problem.mfcs})
    if missing or unknown:
        raise ConfigError(f"plan.layouts: give one layout per MFC; missing {missing}, unknown {unknown}")
    plan = []
    for mfc in problem.mfcs:
        layout, mb = parse_manual_layout(layouts[mfc.name], f"plan.layouts.{mfc.name}")
        layout.check_world(problem.cluster.world_size)
        reason = runtime_refuses(problem.role(mfc), mfc, layout.strategy, problem.cluster)
        if reason:
            raise LayoutError(f"plan.layouts.{mfc.name}: {reason}")
        plan.append(problem.candidate(mfc, layout, mb))
    return tuple(plan)


def make_plan(cfg: ExperimentConfig, cluster: ClusterSpec | None = None, *, seed: int | None = None,
              time_budget_seconds: float | None = None,
              max_steps: int = 40000, with_baselines: bool = True) -> PlanOutcome:
    """Choose the plan ``cfg.plan.mode`` asks for; refuse (PlanError) plans that do not fit in memory.

    ``plan.execution``: ``sync`` plans as always; ``async`` takes the manual layouts, or else the best split
    (``async_plan.best_async_plan``); ``auto`` plans both and keeps the faster (``choose_mode``)."""
    if cfg.plan.execution == ExecutionSetting.AUTO:
        return choose_mode(cfg, cluster, seed=seed, time_budget_seconds=time_budget_seconds, max_steps=max_steps,
                           with_baselines=with_baselines)
    problem = build_problem(cfg, cluster)
    mode = cfg.plan.mode
    if cfg.plan.execution == ExecutionSetting.ASYNC and mode != PlanMode.MANUAL:
        split = best_async_plan(problem)
        if split is None:
            raise PlanError(f"plan.execution async: no split of the {problem.cluster.world_size} ranks into generation "
                            "and training ranks fits; add ranks or set plan.execution=sync")
        return PlanOutcome(problem, split[0], split[1], "async-split", {})
    if mode == PlanMode.MANUAL:
        plan = manual_plan(cfg, problem)
        ev = evaluate(problem, plan)
        if not ev.feasible:
            raise PlanError(f"plan.layouts need {ev.peak_memory_bytes / GIB:.1f} GiB on the fullest device, "
                            f"{problem.capacity_bytes / GIB:.1f} GiB usable; spread the models over more ranks")
        baselines = _evaluations(_compared(problem)) if with_baselines else {}
        return PlanOutcome(problem, plan, ev, "manual", baselines)
    if mode == PlanMode.SEARCH and cfg.plan.shard_frozen == "auto" and (sharded := sharded_variant(problem)) is not None:
        return _faster_of(cfg, (problem, sharded), seed, time_budget_seconds, max_steps)
    check_fits(problem)
    found = _compared(problem) if (with_baselines or mode == PlanMode.SEARCH) else {}
    baselines = _evaluations(found)
    if mode == PlanMode.HEURISTIC:
        name = cfg.plan.heuristic
        got = found.get(name) if found else baseline(problem, name)
        if got is None:
            baseline(problem, name)  # refuses an unknown name
            raise PlanError(f"the {name} heuristic has no plan that fits here; use plan.mode=search")
        # A peer's plan was scored with the peer's memory settings; the runtime runs the config's.
        plan = rebased(problem, got[0])
        reason = untrainable(problem, plan)
        if reason:
            raise PlanError(f"the {name} heuristic's layouts cannot train here ({reason}); use plan.mode=search")
        ev = evaluate(problem, plan)
        if not ev.feasible:
            raise PlanError(f"the {name} layouts need {ev.peak_memory_bytes / GIB:.1f} GiB on the fullest device with this "
                            f"config's memory settings, {problem.capacity_bytes / GIB:.1f} GiB usable; set models.<m>.zero_stage=3 "
                            f"(and gradient_checkpointing) as {name} does, or use plan.mode=search")
        return PlanOutcome(problem, plan, ev, "heuristic", baselines)
    return _searched(cfg, problem, found, seed, time_budget_seconds, max_steps)


def _searched(cfg: ExperimentConfig, problem: PlanProblem, found: Found, seed: int | None, time_budget_seconds: float | None,
              max_steps: int) -> PlanOutcome:
    budget = cfg.plan.time_budget_seconds if time_budget_seconds is None else time_budget_seconds
    result = search(problem, seed=cfg.seed if seed is None else seed, time_budget_seconds=budget, max_steps=max_steps,
                    initial=starting_plans(problem, found))
    if not result.evaluation.feasible:
        raise PlanError(f"the search found no plan that fits ({result.evaluation.peak_memory_bytes / GIB:.1f} GiB on the "
                        f"fullest device, {problem.capacity_bytes / GIB:.1f} GiB usable); add nodes or raise zero_stage")
    return PlanOutcome(problem, result.best, result.evaluation, "search", _evaluations(found), result)


def sharded_variant(problem: PlanProblem) -> PlanProblem | None:
    """``problem`` with every frozen model the runtime can shard held 1/dp per rank of its home layout
    (``ModelRole.shard_frozen``, ``runtime/store/sharded_frozen.py``): one not trained, not moved by an EMA, without
    LoRA or experts, not offloaded when idle, whose one MFC is an inference (so it runs on its home layout).
    None when there is no such model left unsharded."""
    ema = set(ema_targets(problem.graph))
    roles = dict(problem.roles)
    for name, role in problem.roles.items():
        mfcs = [m for m in problem.mfcs if m.model == name]
        if (not role.trainable and not role.shard_frozen and name not in ema and role.arch.lora is None
                and not role.arch.is_moe and not role.offload_when_idle and len(mfcs) == 1
                and mfcs[0].kind is MFCKind.INFERENCE):
            roles[name] = replace(role, shard_frozen=True)
    if roles == problem.roles:
        return None
    return PlanProblem(problem.graph, roles, problem.cluster,
                       estimator=Estimator(problem.cluster, engine=problem.estimator.engine),
                       samples_per_iteration=problem.samples_per_iteration, execution=problem.execution)


def _faster_of(cfg: ExperimentConfig, problems: tuple[PlanProblem, ...], seed: int | None, time_budget_seconds: float | None,
               max_steps: int) -> PlanOutcome:
    """``plan.shard_frozen: auto``: search each problem (frozen models whole, then sharded) that fits and keep the
    faster plan (the first on a tie); when none fits, the first problem's one-line refusal."""
    outcomes, refusals = [], []
    for problem in problems:
        try:
            check_fits(problem)
            outcomes.append(_searched(cfg, problem, _compared(problem), seed, time_budget_seconds, max_steps))
        except PlanError as refused:
            refusals.append(refused)
    if not outcomes:
        raise refusals[0]
    return min(outcomes, key=lambda o: o.evaluation.iteration_seconds)


def _compared(problem: PlanProblem) -> Found:
    """The peers' default plans, then the restricted searches (names in baselines.LABELS)."""
    return {**all_baselines(problem), **all_references(problem)}


def _evaluations(found: Found) -> dict[str, PlanEvaluation | None]:
    return {name: (got[1] if got is not None else None) for name, got in found.items()}


def with_execution(cfg: ExperimentConfig, execution: Execution) -> ExperimentConfig:
    """``cfg`` with ``plan.execution``, ``plan.staleness``, ``plan.push_every`` and ``plan.partial_rollouts`` set
    to ``execution`` (sync keeps the staleness and push interval as configured)."""
    match execution:
        case Sync():
            plan = replace(cfg.plan, execution=ExecutionSetting.SYNC, partial_rollouts=False)
        case Async(staleness, push_every, partial):
            plan = replace(cfg.plan, execution=ExecutionSetting.ASYNC, staleness=staleness, push_every=push_every,
                           partial_rollouts=partial)
        case _:
            assert_never(execution)
    return replace(cfg, plan=plan)


def choose_mode(cfg: ExperimentConfig, cluster: ClusterSpec | None = None, *, seed: int | None = None,
                time_budget_seconds: float | None = None, max_steps: int = 40000,
                with_baselines: bool = True) -> PlanOutcome:
    """``plan.execution: auto``: the synchronous plan (``plan.mode`` as given) and the best async plan over
    ``STALENESS_CHOICES`` x push intervals x splits (and, with ``plan.partial_rollouts`` set, partial rollouts
    where ``staleness > push_every``); the faster by predicted samples/s wins (sync on a tie, and the smallest
    staleness among equal async plans, whole batches before partial ones). The outcome's problem runs the chosen mode."""
    if cfg.plan.mode == PlanMode.MANUAL:
        raise ConfigError("plan.execution auto chooses the layouts of each mode; set plan.mode=search (or choose "
                          "plan.execution sync or async for manual layouts)")
    sync_cfg = with_execution(cfg, Sync())
    sync = make_plan(sync_cfg, cluster, seed=seed, time_budget_seconds=time_budget_seconds, max_steps=max_steps,
                     with_baselines=with_baselines)
    sync_rate = sync.problem.samples_per_iteration / sync.evaluation.iteration_seconds
    best: tuple[float, PlanOutcome] | None = None
    grid = [(staleness, push_every, partial) for staleness in STALENESS_CHOICES for push_every in range(1, staleness + 1)
            for partial in ((False, True) if cfg.plan.partial_rollouts and staleness > push_every else (False,))]
    for staleness, push_every, partial in grid:
        async_cfg = with_execution(cfg, Async(staleness, push_every, partial))
        try:
            problem = build_problem(async_cfg, cluster)
        except ConfigError:  # an algorithm without an async mode
            continue
        found = best_async_plan(problem)
        if found is None or not found[1].feasible:
            continue
        rate = problem.samples_per_iteration / found[1].iteration_seconds
        if best is None or rate > best[0]:
            best = (rate, PlanOutcome(problem, found[0], found[1], "async-split", sync.baselines))
    faster = best is not None and best[0] > sync_rate
    chosen = best[1] if best is not None and faster else sync
    ex = best[1].problem.execution if best is not None else None
    choice = ModeChoice("async" if faster else "sync", sync_rate, best[0] if best is not None else None,
                        ex.staleness if ex else 0, ex.push_every if ex else 0, ex.partial if ex else False)
    return replace(chosen, mode_choice=choice)
