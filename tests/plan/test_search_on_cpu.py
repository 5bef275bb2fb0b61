import pytest

from restage.cluster import load_cluster
from restage.graph import MFC, DataflowGraph
from restage.models.presets import preset
from restage.plan.peers.baselines import all_baselines
from restage.plan.plan_score import evaluate
from restage.plan.problem import PlanProblem
from restage.plan.roles import ModelRole
from restage.plan.search import plan_count, search


@pytest.fixture(scope="module")
def small():
    """Four MFCs on 2 nodes x 2 devices: about ten thousand plans, few enough to enumerate."""
    graph = DataflowGraph((
        MFC("gen", "generate", "actor", ("prompts",), ("seqs",), 32, 128, 128),
        MFC("ref_inf", "inference", "ref", ("seqs",), ("ref_lp",), 32, 128, 128),
        MFC("reward_inf", "inference", "reward", ("seqs",), ("rewards",), 32, 128, 128),
        MFC("train", "train_step", "actor", ("seqs", "ref_lp", "rewards"), (), 32, 128, 128),
    ))
    roles = {"actor": ModelRole("actor", preset("llama-1b"), "bf16", trainable=True),
             "ref": ModelRole("ref", preset("llama-1b"), "bf16"),
             "reward": ModelRole("reward", preset("llama-1b", critic=True), "bf16")}
    problem = PlanProblem(graph, roles, load_cluster("a100-80gb", nodes=2, devices_per_node=2), keep_per_size=1)
    assert 1000 < plan_count(problem) <= 20000
    return problem, search(problem, method="exhaustive")


@pytest.mark.parametrize("seed", [1, 2])
def test_annealing_finds_the_enumerated_optimum(small, seed):
    problem, exhaustive = small
    annealed = search(problem, method="anneal", seed=seed, max_steps=1500, time_budget_seconds=120)
    assert annealed.stopped_by == "steps" and annealed.steps == 1500
    assert annealed.evaluation.cost == pytest.approx(exhaustive.evaluation.cost, rel=1e-9)
    # The optimum runs the two inference MFCs side by side on disjoint halves.
    ref, reward = annealed.best[1].layout.mesh, annealed.best[2].layout.mesh
    assert not set(ref) & set(reward)


def test_exhaustive_search_is_the_minimum_over_every_plan(small):
    problem, exhaustive = small
    assert exhaustive.steps == plan_count(problem)
    assert exhaustive.evaluation.feasible
    top = [ev.cost for _, ev in exhaustive.top]
    assert top == sorted(top) and top[0] == exhaustive.evaluation.cost


def test_search_is_deterministic_for_a_seed_and_never_worse_than_its_starts(small):
    problem, _ = small
    starts = [got for got in all_baselines(problem).values() if got is not None]
    runs = [search(problem, method="anneal", seed=7, max_steps=300, time_budget_seconds=120,
                   initial=[plan for plan, _ in starts]) for _ in range(2)]
    assert runs[0].best == runs[1].best
    assert all(runs[0].evaluation.cost <= ev.cost for _, ev in starts)
    assert evaluate(problem, runs[0].best).iteration_seconds == pytest.approx(runs[0].evaluation.iteration_seconds)


def test_the_time_budget_stops_the_search(small):
    problem, _ = small
    # Unbounded patience too: on a quiet machine the search converged inside 0.3 s, and the test is about the clock.
    result = search(problem, method="anneal", seed=1, max_steps=10**9, time_budget_seconds=0.3, patience_steps=10**9)
    assert result.stopped_by == "time" and result.wall_seconds < 5
