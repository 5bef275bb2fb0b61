"""The peer baselines follow their documented rules, and the search is never worse than any of them."""

import pytest
from plan_helpers import ppo_config

from restage.layout import Strategy
from restage.plan.peers.baselines import LABELS, REFERENCES, all_baselines, all_references, starting_plans
from restage.plan.peers.defaults import PEERS, _proportional
from restage.plan.plan_score import evaluate
from restage.plan.planner import build_problem, make_plan
from restage.plan.search import search


@pytest.fixture(scope="module")
def problem_7b():
    # 7B actor and critic on one node of 8 H100: big enough that memory decides, small enough to be quick.
    return build_problem(ppo_config("llama-7b", "llama-7b", batch=256, gen=128, zero=1))


@pytest.fixture(scope="module")
def found_7b(problem_7b):
    return all_baselines(problem_7b)


def layouts(found, name):
    plan, _ = found[name]
    return {c.mfc: c.layout for c in plan}


def test_deepspeed_chat_and_verl_colocate_everything_data_parallel(found_7b):
    for name in ("deepspeed_chat", "verl"):
        got = layouts(found_7b, name)
        assert {lay.mesh for lay in got.values()} == {tuple(range(8))}
        for mfc, lay in got.items():
            if mfc != "actor_gen":
                assert lay.strategy == Strategy(dp=8)
    # Generation TP: DeepSpeed-Chat starts at --inference_tp_size 1, verl at its default 2.
    assert layouts(found_7b, "deepspeed_chat")["actor_gen"].strategy.tp >= 1
    assert layouts(found_7b, "verl")["actor_gen"].strategy.tp >= 2


def test_peers_train_with_their_own_zero_stage(problem_7b, found_7b):
    # The config says ZeRO-1; DeepSpeed-Chat's plan is scored with ZeRO-3 (parameters and gradients sharded too),
    # NeMo-Aligner's with Megatron's distributed optimizer (ZeRO-1).
    for name, smaller in (("deepspeed_chat", True), ("nemo_aligner", False)):
        plan, _ = found_7b[name]
        train = next(c for c in plan if c.mfc == "actor_train")
        as_configured = problem_7b.candidate("actor_train", train.layout, train.micro_batches)
        if smaller:
            assert train.estimate.state_bytes < as_configured.estimate.state_bytes
        else:
            assert train.estimate.state_bytes == as_configured.estimate.state_bytes


def test_openrlhf_gives_each_model_a_group_in_the_published_proportion():
    assert _proportional(16, [4, 4, 4, 2, 2]) == [4, 4, 4, 2, 2]
    assert _proportional(8, [4, 4, 4, 2, 2]) == [2, 2, 2, 1, 1]
    assert sum(_proportional(12, [4, 4, 4, 2, 2])) == 12
    assert _proportional(4, [4, 4, 4, 2, 2]) is None
    problem = build_problem(ppo_config("llama-1b", "llama-1b", batch=64, gen=64, zero=3, nodes=2))
    found = all_baselines(problem)
    assert found["openrlhf"] is not None
    got = layouts(found, "openrlhf")
    assert [got[m].mesh[0] for m in ("actor_train", "critic_train", "actor_gen")] == [0, 4, 8]
    assert {got["ref_inf"].mesh[0], got["reward_inf"].mesh[0]} == {12, 14}
    assert [got[m].size for m in ("actor_train", "critic_train", "actor_gen", "ref_inf", "reward_inf")] == [4, 4, 4, 2, 2]
    assert got["critic_inf"] == got["critic_train"] and got["actor_train"].strategy.tp == 1


def test_nemo_aligner_runs_two_jobs_with_one_megatron_strategy_each(found_7b):
    got = layouts(found_7b, "nemo_aligner")
    actor_job = {got[m] for m in ("actor_gen", "ref_inf", "actor_train")}
    critic_job = {got[m] for m in ("critic_inf", "reward_inf", "critic_train")}
    assert len(actor_job) == 1 and len(critic_job) == 1
    (a,), (c,) = actor_job, critic_job
    assert a.mesh == tuple(range(4)) and c.mesh == tuple(range(4, 8))
    assert a.strategy.tp >= 1 and a.strategy.pp >= 1


def test_search_is_never_worse_than_a_plan_it_starts_from_nor_any_reference(problem_7b, found_7b):
    """Seeded with the peers' and references' layouts (re-estimated as restage's runtime would run them), the search
    ends no slower than any of them that fits in memory. The peers' own figures are not a bound: they are scored
    with engines restage's runtime does not have (vLLM generation, ``peer_engines``), so a peer may be predicted
    faster than any plan restage can run; ``bench/plan_paper.py`` reports that comparison."""
    references = all_references(problem_7b)
    assert set(found_7b) == set(PEERS) and set(references) == set(REFERENCES)
    assert all(name in LABELS for name in (*PEERS, *REFERENCES))
    starts = starting_plans(problem_7b, found_7b | references)
    result = search(problem_7b, seed=1, time_budget_seconds=10, max_steps=1500, initial=starts)
    assert len(starts) >= len([got for got in references.values() if got is not None])
    fitting = [ev for ev in (evaluate(problem_7b, plan) for plan in starts) if ev.feasible]
    assert fitting  # a start over the memory limit bounds nothing: the search's objective inflates it
    for ev in fitting:
        assert result.evaluation.iteration_seconds <= ev.iteration_seconds * (1 + 1e-9)
    for got in references.values():
        if got is not None:
            assert result.evaluation.iteration_seconds <= got[1].iteration_seconds * (1 + 1e-9)


def test_heuristic_mode_runs_a_peer_layout_with_the_config_memory_settings():
    cfg = ppo_config("llama-7b", "llama-7b", batch=256, gen=128, zero=3,
                     plan={"mode": "heuristic", "heuristic": "deepspeed_chat"})
    outcome = make_plan(cfg)
    assert {c.layout.mesh for c in outcome.plan} == {tuple(range(8))}
    assert outcome.evaluation.feasible
    assert outcome.baselines["deepspeed_chat"] is not None
