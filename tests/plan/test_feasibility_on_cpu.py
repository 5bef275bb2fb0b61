"""Layouts the runtime cannot train in are never proposed: one rule (models.sharding.training_layout_problem) for the
planner's candidates, the search's starting plans, manual layouts and the runtime; batches too small for a layout's DP ranks
are never proposed either, and a batch no layout can take is refused in one line naming the MFC."""

import dataclasses

import pytest
from plan_helpers import ppo_config

from restage.config.sections import ClusterRef
from restage.errors import LayoutError, PlanError
from restage.layout import Strategy
from restage.models.presets import preset
from restage.models.sharding import training_layout_problem
from restage.plan.peers.baselines import all_baselines, all_references, starting_plans
from restage.plan.planner import build_problem, check_fits, make_plan, manual_plan
from restage.plan.problem import strategies_for, untrainable
from restage.plan.search import search


def tiny_ppo(devices=4, batch=8, zero=0, **extra):
    cfg = ppo_config("llama-tiny", "llama-tiny", cluster="local-cpu", batch=batch, prompt=16, gen=16, zero=zero, **extra)
    return dataclasses.replace(cfg, cluster=ClusterRef("local-cpu", 1, devices))


def tied_actor(problem):
    """The problem with a tied-embedding actor (and reference): the runtime trains it only with pp=1."""
    for name in ("actor", "ref"):
        role = problem.roles[name]
        problem.roles[name] = dataclasses.replace(role, arch=dataclasses.replace(role.arch, tied_embeddings=True))
    return problem


def test_the_rule_names_what_to_change():
    tied = dataclasses.replace(preset("llama-tiny"), tied_embeddings=True)
    assert training_layout_problem("actor", tied, 1, Strategy(dp=2, pp=2), 4, 4) == (
        "models.actor: training a model with tied embeddings under pp=2 is not supported; train it with pp=1 "
        "(tp and dp are fine)")
    assert training_layout_problem("actor", preset("llama-tiny"), 3, Strategy(dp=2), 2, 4) == (
        "models.actor: zero_stage=3 needs its training layout to span all 4 ranks (it spans 2); use zero_stage 1 or 2")
    assert training_layout_problem("actor", tied, 3, Strategy(dp=2, tp=2), 4, 4) is None
    assert training_layout_problem("actor", preset("llama-tiny"), 1, Strategy(dp=2, pp=2), 4, 8) is None


def test_a_tied_model_is_never_planned_to_train_with_pp():
    problem = tied_actor(build_problem(tiny_ppo()))
    train, gen = problem.graph["actor_train"], problem.graph["actor_gen"]
    assert strategies_for(4, problem.role(train), train, problem.cluster) == [Strategy(dp=2, tp=2)]  # no dp2pp2
    assert {s.pp for s in strategies_for(4, problem.role(gen), gen, problem.cluster)} == {1, 2}  # generation may
    assert {c.layout.strategy.pp for c in problem.candidates(train)} == {1}
    plans = starting_plans(problem, {**all_baselines(problem), **all_references(problem)})  # where the search starts
    assert plans and all(c.layout.strategy.pp == 1 for p in plans for c in p if c.mfc == "actor_train")
    best = search(problem, time_budget_seconds=1, max_steps=200, initial=plans).best
    assert untrainable(problem, best) is None and best[problem.index["actor_train"]].layout.strategy.pp == 1
    assert {c.layout.strategy.pp for c in build_problem(tiny_ppo()).candidates("actor_train")} == {1, 2}  # untied


def test_zero3_trains_only_over_the_whole_world():
    problem = build_problem(tiny_ppo(zero=3))
    train = problem.graph["actor_train"]
    assert [strategies_for(size, problem.role(train), train, problem.cluster) for size in (1, 2)] == [[], []]
    assert strategies_for(4, problem.role(train), train, problem.cluster)
    assert {c.layout.size for c in problem.candidates(train)} == {4}


def test_a_manual_layout_the_runtime_would_refuse_is_refused_by_the_planner():
    layouts = {"actor_gen": "ranks:0-3 dp4", "reward_inf": "ranks:0-3 dp4", "ref_inf": "ranks:0-3 dp4",
               "critic_inf": "ranks:0-3 dp4", "actor_train": "ranks:0-3 dp2pp2", "critic_train": "ranks:0-3 dp4"}
    cfg = tiny_ppo(plan={"mode": "manual", "layouts": layouts})
    with pytest.raises(LayoutError) as err:
        manual_plan(cfg, tied_actor(build_problem(cfg)))
    assert str(err.value) == ("plan.layouts.actor_train: models.actor: training a model with tied embeddings under "
                              "pp=2 is not supported; train it with pp=1 (tp and dp are fine)")
    assert manual_plan(cfg, build_problem(cfg))[4].layout.strategy == Strategy(dp=2, pp=2)  # untied: fine


def test_a_batch_smaller_than_the_world_is_planned_on_fewer_ranks():
    # 8 ranks, 1 prompt: no strategy over all 8 ranks has dp 1 (tp <= 2 heads, pp <= 2 layers); this was
    # refused as "do not fit ... the leanest plan has no layout".
    outcome = make_plan(tiny_ppo(devices=8, batch=1, algo={"minibatches": 1}), with_baselines=False,
                        time_budget_seconds=1, max_steps=200)
    assert [(c.mfc, c.layout.strategy.dp) for c in outcome.plan if c.layout.strategy.dp > 1] == []
    for cand in outcome.plan:
        mfc = outcome.problem.graph[cand.mfc]
        assert mfc.n_seqs >= cand.layout.strategy.dp * (mfc.minibatches if mfc.kind == "train_step" else 1)


def test_a_batch_no_layout_can_take_is_refused_naming_the_mfc():
    with pytest.raises(PlanError) as err:
        check_fits(build_problem(tiny_ppo(batch=1)))  # 4 minibatches of 1 sequence
    assert str(err.value) == ("actor_train: its 1 sequences per step cannot fill 4 minibatches; raise run.batch_size "
                              "or lower algo.minibatches")
    with pytest.raises(PlanError) as err:
        check_fits(build_problem(tiny_ppo(devices=8, batch=4, zero=3, algo={"minibatches": 4})))
    assert str(err.value) == ("actor_train: models.actor: zero_stage=3 trains on all 8 ranks, and its 4 sequences per "
                              "step fill no DP size a layout over them has; raise run.batch_size or use zero_stage 1 "
                              "or 2")
    check_fits(build_problem(tiny_ppo(batch=4)))  # 1 sequence per minibatch: fine
