"""The planner never proposes a layout the runtime refuses, and proposes every one it takes (within the planner's own
policies: TP inside a node, a sequence per DP rank): property-style over the shipped tiny jobs, tiny presets with
ZeRO-3 and tied embeddings, and the paper's configs. "The runtime refuses" is its start-up check
(``runtime.store.feasibility.schedule_problem``) on a schedule holding the layout; a schedule ``build_schedule`` writes
passes that check whole."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
from plan_helpers import ppo_config

from restage.config.load import load_config
from restage.config.sections import ClusterRef
from restage.demo import ensure_arith_model, ensure_tiny_model
from restage.layout import Layout, Strategy
from restage.plan.layout_cost import dp_size_ok
from restage.plan.peers.baselines import all_baselines, all_references, starting_plans
from restage.plan.planner import build_problem, make_plan
from restage.plan.problem import PlanProblem, mesh_options, strategies_for
from restage.plan.schedule import build_schedule
from restage.runtime.store.feasibility import schedule_problem

REPO = Path(__file__).resolve().parents[2]
TINY_JOBS = sorted(p.name for p in (REPO / "jobs").glob("*_tiny.yaml"))
PAPER_JOBS = sorted(p.name for p in (REPO / "jobs" / "paper").glob("*.yaml"))


def _devices(cfg, devices: int, nodes: int = 1):
    return dataclasses.replace(cfg, cluster=ClusterRef("local-cpu", nodes, devices))


def _tied(cfg):
    """The config's problem with tied-embedding actor and reference (the runtime trains such a model only with pp=1)."""
    problem = build_problem(cfg)
    for name in ("actor", "ref"):
        role = problem.roles[name]
        problem.roles[name] = dataclasses.replace(role, arch=dataclasses.replace(role.arch, tied_embeddings=True))
    return problem


def _tiny_job(name: str, devices: int, nodes: int = 1):
    ensure_tiny_model(REPO)
    ensure_arith_model(REPO)  # jobs/grpo_calculator_tiny.yaml's model (a fresh clone has neither)
    cfg = load_config(REPO / "jobs" / name)
    models = {m: dataclasses.replace(spec, path=str(REPO / spec.path)) if spec.path else spec
              for m, spec in cfg.models.items()}
    return _devices(dataclasses.replace(cfg, models=models), devices, nodes)


def _preset(zero: int = 1, devices: int = 8):
    return _devices(ppo_config("llama-tiny", "llama-tiny", batch=16, prompt=16, gen=16, zero=zero), devices)


# (config, problem) makers: every shipped tiny job on 8 devices and on 2 nodes of 4, tiny presets with ZeRO-3 and
# with tied embeddings, and every paper config on its own cluster.
CASES = ({f"{job}-8": (lambda job=job: _tiny_job(job, 8)) for job in TINY_JOBS}
         | {f"{job}-2x4": (lambda job=job: _tiny_job(job, 4, nodes=2)) for job in TINY_JOBS}
         | {"llama-tiny-zero3": lambda: _preset(zero=3), "llama-tiny-tied": lambda: _preset()}
         | {job: (lambda job=job: load_config(REPO / "jobs" / "paper" / job)) for job in PAPER_JOBS})


def _problem(case: str) -> tuple[object, PlanProblem]:
    cfg = CASES[case]()
    return cfg, (_tied(cfg) if case.endswith("-tied") else build_problem(cfg))


def _schedule(problem: PlanProblem, layouts: dict[str, Layout]) -> SimpleNamespace:
    """What the runtime's start-up check reads of a schedule placing each MFC of ``layouts`` there (a model's home
    is its home MFC's layout, else the first candidate of that MFC)."""
    models = {}
    for mfc in problem.mfcs:
        if mfc.name in layouts and mfc.model not in models:
            home = problem.home[mfc.model]
            layout = layouts[home] if home in layouts else problem.candidates(home)[0].layout
            role = problem.roles[mfc.model]
            models[mfc.model] = SimpleNamespace(arch=role.arch, held_arch=role.arch, home_layout=layout,
                                                trainable=role.trainable, zero_stage=role.zero_stage)
    mfcs = tuple(SimpleNamespace(mfc=problem.graph[name], layout=layout) for name, layout in layouts.items())
    return SimpleNamespace(models=models, mfcs=mfcs)


def _refusal(cfg, problem: PlanProblem, mfc, layout: Layout) -> str | None:
    return schedule_problem(_schedule(problem, {mfc.name: layout}), problem.cluster.world_size)


def _all_strategies(size: int) -> list[Strategy]:
    return [Strategy(dp=size // (tp * pp), tp=tp, pp=pp) for tp in range(1, size + 1) if size % tp == 0
            for pp in range(1, size // tp + 1) if (size // tp) % pp == 0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_layout_the_search_can_propose_is_taken_by_the_runtime(case):
    cfg, problem = _problem(case)
    checked = 0
    for mfc in problem.mfcs:
        for cand in problem.candidates(mfc):  # what the search's moves pick from
            assert _refusal(cfg, problem, mfc, cand.layout) is None, (mfc.name, str(cand.layout))
            checked += 1
    plans = starting_plans(problem, {**all_baselines(problem), **all_references(problem)})  # where it starts
    for plan in plans:
        layouts = {c.mfc: c.layout for c in plan}
        assert schedule_problem(_schedule(problem, layouts), problem.cluster.world_size) is None
    assert checked >= len(problem.mfcs) and all(problem.candidates(m) for m in problem.mfcs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_candidates_are_exactly_the_layouts_the_runtime_takes(case):
    """Over every mesh size and every (dp, tp, pp): a strategy the runtime refuses is never a candidate, and one it
    takes is one unless a planner policy (TP inside a node, a sequence per DP rank per minibatch) excludes it."""
    cfg, problem = _problem(case)
    cluster = problem.cluster
    refused = 0
    for mfc in problem.mfcs:
        proposed = {(c.layout.size, c.layout.strategy) for c in problem.candidates(mfc)}
        for size in sorted({size for _, size in mesh_options(cluster)}):
            offered = set(strategies_for(size, problem.role(mfc), mfc, cluster))
            for strategy in _all_strategies(size):
                reason = _refusal(cfg, problem, mfc, Layout.contiguous(0, strategy))
                policy = strategy.tp <= cluster.devices_per_node and dp_size_ok(mfc, strategy.dp)
                assert (strategy in offered) == (reason is None and policy), (mfc.name, size, str(strategy), reason)
                if reason is not None:
                    refused += 1
                    assert (size, strategy) not in proposed
    assert refused > 0  # every case has tp or pp values its models cannot take


def test_the_constructed_refusals_are_the_runtimes_rules():
    cfg, tied = _problem("llama-tiny-tied")
    train, gen = tied.graph["actor_train"], tied.graph["actor_gen"]
    assert _refusal(cfg, tied, train, Layout.contiguous(0, Strategy(dp=4, pp=2))) == (
        "models.actor: training a model with tied embeddings under pp=2 is not supported; train it with pp=1 "
        "(tp and dp are fine)")
    assert _refusal(cfg, tied, gen, Layout.contiguous(0, Strategy(dp=4, pp=2))) is None  # not trained there
    assert _refusal(cfg, tied, gen, Layout.contiguous(0, Strategy(dp=2, tp=4))) == (
        "actor_gen: models.actor: tp=4 does not divide 4 attention heads and 2 KV heads; use tp in [1, 2]")
    cfg, zero3 = _problem("llama-tiny-zero3")
    assert _refusal(cfg, zero3, zero3.graph["actor_train"], Layout.contiguous(0, Strategy(dp=4))) == (
        "models.actor: zero_stage=3 needs its training layout to span all 8 ranks (it spans 4); use zero_stage 1 or 2")
    assert {c.layout.size for c in zero3.candidates("actor_train")} == {8}
    assert {c.layout.strategy.pp for c in tied.candidates("actor_train")} == {1}


@pytest.mark.parametrize("case", ["ppo_tiny.yaml-8", "grpo_tiny.yaml-2x4", "dpo_tiny.yaml-8", "llama-tiny-zero3",
                                  "ppo-7b-h100x8-gen128.yaml", "ppo-70b-h100x128-gen896.yaml"])
def test_a_schedule_the_planner_writes_passes_the_runtimes_start_up_check(case):
    cfg = CASES[case]()
    outcome = make_plan(cfg, with_baselines=False, time_budget_seconds=1, max_steps=100, seed=0)
    schedule = build_schedule(cfg, outcome, exact=False)
    assert schedule_problem(schedule, schedule.world_size) is None
    homes = {name: info.home_layout for name, info in schedule.models.items()}
    assert set(homes) == set(cfg.models) & {m.model for m in outcome.problem.mfcs}
    trained = [name for name, info in schedule.models.items() if info.trainable]
    assert trained  # the check covered a trained model's home
    # The same schedule with a trained model's home moved to a layout the runtime refuses is refused, naming it.
    name = trained[0]
    bad = Layout.contiguous(0, Strategy(tp=3))  # no model here has a head count divisible by 3
    models = {**schedule.models, name: dataclasses.replace(schedule.models[name], home_layout=bad)}
    assert schedule_problem(dataclasses.replace(schedule, models=models), schedule.world_size).startswith(
        f"models.{name}: tp=3 does not divide")
