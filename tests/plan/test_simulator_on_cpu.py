import pytest
from plan_helpers import StubEstimator, ideal_cluster

from restage.graph import MFC, DataflowGraph
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.plan_score import evaluate
from restage.plan.problem import PlanProblem
from restage.plan.roles import ModelRole
from restage.plan.simulator import Task, simulate, steady_state


def test_list_scheduling_overlaps_disjoint_ranks_and_serialises_shared_ones():
    disjoint = simulate([Task("a", (0, 1), 2.0), Task("b", (2, 3), 3.0), Task("c", (0, 1, 2, 3), 1.0)])
    assert disjoint["b"].start_seconds == 0.0 and disjoint.makespan_seconds == 4.0
    shared = simulate([Task("a", (0, 1), 2.0), Task("b", (1, 2), 3.0), Task("c", (3,), 1.0, (("a", 0.5),))])
    assert shared["b"].start_seconds == 2.0 and shared["c"].start_seconds == 2.5 and shared.makespan_seconds == 5.0


def ppo_like():
    return DataflowGraph((
        MFC("gen", "generate", "actor", ("prompts",), ("seqs",), 8, 4, 4),
        MFC("ref_inf", "inference", "ref", ("seqs",), ("ref_lp",), 8, 4, 4),
        MFC("reward_inf", "inference", "reward", ("seqs",), ("rewards",), 8, 4, 4),
        MFC("train", "train_step", "actor", ("seqs", "ref_lp", "rewards"), (), 8, 4, 4),
    ))


def roles(*names, trainable=("actor",)):
    return {n: ModelRole(n, preset("llama-tiny"), dtype="bf16", trainable=n in trainable) for n in names}


def plan_of(problem, layouts):
    return tuple(problem.candidate(m, layouts[m.name]) for m in problem.mfcs)


def test_ppo_like_makespan_by_hand_with_overlap_of_disjoint_meshes():
    seconds = {"gen": 4.0, "ref_inf": 2.0, "reward_inf": 3.0, "train": 5.0}
    problem = PlanProblem(ppo_like(), roles("actor", "ref", "reward"), ideal_cluster(), StubEstimator(seconds))
    full, low, high = (Layout(tuple(r), Strategy(dp=len(r))) for r in ((0, 1, 2, 3), (0, 1), (2, 3)))
    side_by_side = evaluate(problem, plan_of(problem, {"gen": full, "ref_inf": low, "reward_inf": high, "train": full}))
    assert side_by_side.iteration_seconds == pytest.approx(4 + max(2, 3) + 5)
    assert side_by_side.timeline["ref_inf"].start_seconds == side_by_side.timeline["reward_inf"].start_seconds
    colocated = evaluate(problem, plan_of(problem, {m: full for m in seconds}))
    assert colocated.iteration_seconds == pytest.approx(4 + 2 + 3 + 5)


def test_reallocation_and_transfer_seconds_enter_the_makespan():
    graph = DataflowGraph((MFC("gen", "generate", "actor", ("prompts",), ("x",), 8, 4, 4),
                           MFC("train", "train_step", "actor", ("x",), (), 8, 4, 4)))
    cluster = ideal_cluster()
    bandwidth = 1e9
    cluster = type(cluster)(**{**cluster.to_json(), "intra_node_bandwidth_bytes_per_second": bandwidth,
                               "intra_node_latency_seconds": 1e-3, "network_efficiency": 1.0})
    problem = PlanProblem(graph, roles("actor"), cluster, StubEstimator({"gen": 4.0, "train": 5.0}))
    low, high = Layout((0, 1), Strategy(dp=2)), Layout((2, 3), Strategy(dp=2))
    ev = evaluate(problem, plan_of(problem, {"gen": low, "train": high}))
    h, inter, kv, vocab = 64, 172, 32, 512  # llama-tiny: 4 heads of 16, 2 KV heads
    params = 2 * (2 * h + 2 * h * h + 2 * h * kv + 3 * h * inter) + 2 * vocab * h + h
    realloc = params * 2 / bandwidth + 1e-3  # each gen rank receives the whole bf16 model from its own sender
    transfer = 8 * 8 * 4 / 2 / bandwidth + 1e-3  # key "x": 4 bytes per token, half the batch per DP pair
    assert ev.timeline["realloc:actor:0"].end_seconds == pytest.approx(realloc)
    assert ev.iteration_seconds == pytest.approx(realloc + 4 + transfer + 5)


def two_stage(models=("m1", "m2"), kinds=("inference", "inference"), trainable=()):
    graph = DataflowGraph((MFC("a", kinds[0], models[0], ("prompts",), ("x",), 8, 4, 4),
                           MFC("b", kinds[1], models[1], ("x",), ("y",) if kinds[1] != "train_step" else (), 8, 4, 4)))
    return PlanProblem(graph, roles(*set(models), trainable=trainable), ideal_cluster(), StubEstimator({"a": 4.0, "b": 4.0}))


def test_steady_state_overlaps_iterations_only_where_versions_allow():
    low, high = Layout((0, 1), Strategy(dp=2)), Layout((2, 3), Strategy(dp=2))
    frozen = two_stage()
    plan = plan_of(frozen, {"a": low, "b": high})
    assert steady_state(frozen, plan, overlap=False)[0] == pytest.approx(8.0)
    assert steady_state(frozen, plan, overlap=True)[0] == pytest.approx(4.0)  # a of k+1 runs beside b of k
    # The same shape where b trains a's model: a of k+1 needs b's update of k (and a reallocation).
    trained = two_stage(models=("m1", "m1"), kinds=("generate", "train_step"), trainable=("m1",))
    plan = plan_of(trained, {"a": low, "b": high})
    assert steady_state(trained, plan, overlap=True)[0] == pytest.approx(8.0)


def test_memory_of_colocated_models_adds_up():
    stub = StubEstimator({"gen": 1, "ref_inf": 1, "reward_inf": 1, "train": 1}, transient_bytes=10, state_bytes=100)
    problem = PlanProblem(ppo_like(), roles("actor", "ref", "reward"), ideal_cluster(), stub)
    full, low, high = (Layout(tuple(r), Strategy(dp=len(r))) for r in ((0, 1, 2, 3), (0, 1), (2, 3)))
    together = evaluate(problem, plan_of(problem, {"gen": full, "ref_inf": full, "reward_inf": full, "train": full}))
    assert together.peak_memory_bytes == 3 * 100 + 10  # three homes on every rank, one MFC's activations at a time
    apart = evaluate(problem, plan_of(problem, {"gen": full, "ref_inf": low, "reward_inf": high, "train": full}))
    assert apart.peak_memory_bytes == 2 * 100 + 10
    assert apart.mfc_peak_memory_bytes[0] == 2 * 100 + 10  # gen runs on train's layout: no copy
    copy = evaluate(problem, plan_of(problem, {"gen": low, "ref_inf": low, "reward_inf": high, "train": full}))
    assert copy.mfc_peak_memory_bytes[0] == 2 * 100 + 10 + 100  # actor's home and ref, plus gen's parameter copy
