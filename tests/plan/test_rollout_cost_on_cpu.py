"""restage's rollout engine as the estimator costs it (``plan/generation_cost.py``, ``estimator._generate``): slots from the
memory budget, rounds of refill, one prefill per prompt group, CUDA graphs where the runtime replays them, one host
check every k steps. Each expected figure is built here from the formula's parts."""

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from restage.cluster import load_cluster
from restage.errors import ConfigError
from restage.graph import MFC, MFCOptions
from restage.layout import Layout, Strategy
from restage.models.flops import block_shape
from restage.models.presets import preset
from restage.plan.activations import forward_workspace_elements_per_token
from restage.plan.estimator import Estimator
from restage.plan.generation_cost import GRAPH_BLOCK_SECONDS, HOST_CHECK_SECONDS, OneBatchEngine, RestageEngine, restage_slots
from restage.plan.model_state import stage_param_elements
from restage.plan.planner import build_problem
from restage.plan.roles import ModelRole
from restage.plan.rollout_cost import lockstep_forwards
from restage.plan.simulator import (
    _home_state_bytes,
    plan_program,
    zero3_generation_mode,
    zero3_in_place,
    zero3_in_place_bytes,
)
from restage.plan.transfer_cost import zero3_gather_seconds
from restage.rollout.budget import GATHER_ONCE_FRACTION, GPU_FREE_MEMORY_FRACTION, RolloutLimits
from restage.schedule.ops import Run

sys.path.insert(0, str(Path(__file__).parent))
from plan_helpers import ppo_config  # noqa: E402

GIB = 1 << 30
CONTIGUOUS = RolloutLimits(paged=False)  # generation.kv_cache: contiguous (the paged cache: test_paged_cache_cost_on_cpu.py)


@pytest.fixture
def h100():
    return load_cluster("h100-80gb")


def gen_mfc(n_seqs, prompt, gen, group=1):
    return MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs",), n_seqs, prompt, gen,
               options=MFCOptions(group_size=group))


def parts(est):
    return dict(est.breakdown)


def one_rank(strategy=Strategy()):
    return Layout.contiguous(0, strategy)


def test_default_slots_are_the_free_fraction_of_what_the_weights_leave(h100):
    cfg = preset("llama-7b")
    slot_bytes = 2 * 32 * 4096 * 2 * (1024 + 1024)  # K and V, 32 layers, 4096 wide, bf16, 2048 tokens: 1 GiB
    assert slot_bytes == GIB
    weights = stage_param_elements(cfg, 1, 1)[0] * 2
    budget = int(GPU_FREE_MEMORY_FRACTION * (h100.usable_memory_bytes - weights))
    # 0.4 x (72 GiB - 12.6 GiB of weights) = 23.8 GiB: 23 slots of 1 GiB
    assert budget // slot_bytes == 23
    assert restage_slots(h100, RestageEngine(), slot_bytes, weights, 512) == 23
    assert restage_slots(h100, RestageEngine(), slot_bytes, weights, 10) == 10  # never more than the requests
    assert restage_slots(h100, RestageEngine(RolloutLimits(max_slots=16)), slot_bytes, weights, 512) == 16
    assert restage_slots(h100, RestageEngine(RolloutLimits(kv_cache_bytes=5 * GIB + GIB // 2)), slot_bytes,
                         weights, 512) == 5
    # The estimate holds the cache of exactly those slots, each of the whole prompt + answer.
    est = Estimator(h100, engine=RestageEngine(CONTIGUOUS)).estimate(gen_mfc(512, 1024, 1024), ModelRole("actor", cfg), one_rank())
    logits = 23 * block_shape(cfg, 1).head_out * 4
    workspace = forward_workspace_elements_per_token(cfg, 1) * 23 * 1023 * 2  # one admission: 23 prompts less their last token
    assert est.transient_bytes == int(23 * slot_bytes + workspace + logits)


def test_requests_beyond_the_slots_take_rounds_of_refill(h100):
    cfg = preset("llama-7b")
    role, est = ModelRole("actor", cfg), Estimator(h100, engine=RestageEngine(RolloutLimits(max_slots=5)))
    five, twenty, twenty_one = (parts(est.estimate(gen_mfc(n, 128, 256), role, one_rank())) for n in (5, 20, 21))
    assert twenty["decode_seconds"] == pytest.approx(4 * five["decode_seconds"], rel=1e-12)  # ceil(20 / 5) rounds
    assert twenty_one["decode_seconds"] == pytest.approx(5 * five["decode_seconds"], rel=1e-12)  # ceil(21 / 5)
    # one host check per k = 4 steps: 5 rounds x 256 steps / 4 = 320 checks
    assert twenty_one["host_check_seconds"] == pytest.approx(320 * HOST_CHECK_SECONDS, rel=1e-12)


def test_a_group_prompt_is_prefilled_once_and_copied_to_its_siblings(h100):
    cfg = preset("llama-7b")
    role, est = ModelRole("actor", cfg), Estimator(h100, engine=RestageEngine(CONTIGUOUS))
    compute = est.compute_for(role)
    prompt = 512
    grouped = parts(est.estimate(gen_mfc(64, prompt, 128, group=8), role, one_rank()))
    single = parts(est.estimate(gen_mfc(64, prompt, 128, group=1), role, one_rank()))
    kv_token = 2 * 32 * 4096 * 2
    copy = 2 * 56 * (prompt - 1) * kv_token / h100.achievable_memory_bandwidth()  # 56 siblings, read + write
    assert grouped["kv_copy_seconds"] == pytest.approx(copy, rel=1e-12)
    # 8 prompts less their last token (each sample decodes that one itself); the prefill forward has no head
    assert grouped["prefill_seconds"] == pytest.approx(
        32 * compute.block_prefill(8, prompt - 1, 1) + compute.embed_forward(8 * (prompt - 1)) + copy, rel=1e-12)
    assert single["prefill_seconds"] == pytest.approx(
        32 * compute.block_prefill(64, prompt - 1, 1) + compute.embed_forward(64 * (prompt - 1)), rel=1e-12)
    assert "kv_copy_seconds" not in single


def test_cuda_graphs_replace_exactly_the_eager_launch_time_at_tp1_pp1(h100):
    """llama-tiny at one sequence is launch-bound in both modes: each block costs its whole launch term."""
    cfg = preset("llama-tiny")
    role, gen = ModelRole("actor", cfg), 64
    mfc = gen_mfc(1, 32, gen)
    graphs = parts(Estimator(h100).estimate(mfc, role, one_rank()))
    eager = parts(Estimator(h100, engine=RestageEngine(cuda_graphs=False)).estimate(mfc, role, one_rank()))
    launch_term = cfg.num_layers * (h100.block_overhead_seconds - GRAPH_BLOCK_SECONDS)
    assert eager["decode_seconds"] - graphs["decode_seconds"] == pytest.approx(gen * launch_term, rel=1e-9)
    # a call captures its one bucket: a warm-up step and the capture, each an eager step
    assert graphs["graph_capture_seconds"] == pytest.approx(2 * eager["decode_seconds"] / gen, rel=1e-12)
    assert "graph_capture_seconds" not in eager


def test_graphs_only_where_the_runtime_replays_them(h100):
    cfg = preset("llama-7b")
    role, mfc = ModelRole("actor", cfg), gen_mfc(16, 128, 128)
    on, off = Estimator(h100), Estimator(h100, engine=RestageEngine(cuda_graphs=False))
    serial = RolloutLimits(pp_groups=1)  # the stages one after another: each receives and sends inside its step
    serial_on, serial_off = (Estimator(h100, engine=RestageEngine(serial, cuda_graphs=g)) for g in (True, False))
    for strategy in (Strategy(pp=2), Strategy(tp=2, pp=2)):
        # eager there with pp_groups=1, whatever generation.cuda_graphs says
        a, b = (parts(e.estimate(mfc, role, Layout.contiguous(0, strategy))) for e in (serial_on, serial_off))
        assert a == b and "graph_capture_seconds" not in a
        # micro-groups in flight (the default): every stage replays its graphs
        a, b = (parts(e.estimate(mfc, role, Layout.contiguous(0, strategy))) for e in (on, off))
        assert a["decode_seconds"] < b["decode_seconds"] and a["graph_capture_seconds"] > 0
    # tp alone over NCCL: its collectives are captured, so its decode steps replay as graphs
    a, b = (parts(e.estimate(mfc, role, Layout.contiguous(0, Strategy(tp=2)))) for e in (on, off))
    assert a["decode_seconds"] < b["decode_seconds"] and a["graph_capture_seconds"] > 0
    cpu = load_cluster("local-cpu")
    a, b = (parts(Estimator(cpu, engine=e, use_profiles=False).estimate(mfc, role, one_rank()))
            for e in (RestageEngine(), RestageEngine(cuda_graphs=False)))
    assert a == b and "host_check_seconds" not in a  # a CPU runs every op synchronously: no graph, no drain


def test_pipelined_micro_groups_are_costed_with_graphs_and_one_stage_layouts_are_unchanged(h100):
    """pp = 2 with micro-groups in flight replays graphs (``rollout/pipelined.py``): llama-tiny at one sequence is
    launch-bound, so its 2 ticks of one 1-block stage step a token save what one step of both blocks saves at pp = 1;
    each stage captures its graphs once (2 eager stage steps per stage). pp = 1 layouts cost what they did before
    (the figures pinned from the estimator before graphs under pp)."""
    cfg = preset("llama-tiny")
    role, gen = ModelRole("actor", cfg), 64
    mfc, layout = gen_mfc(1, 32, gen), Layout.contiguous(0, Strategy(pp=2))
    on, off = Estimator(h100), Estimator(h100, engine=RestageEngine(cuda_graphs=False))
    graphs, eager = (parts(e.estimate(mfc, role, layout)) for e in (on, off))
    launch_term = cfg.num_layers * (h100.block_overhead_seconds - GRAPH_BLOCK_SECONDS)
    assert eager["decode_seconds"] - graphs["decode_seconds"] == pytest.approx(gen * launch_term, rel=1e-9)
    compute = off.compute_for(role)
    length = 32 + gen  # a graph's attention spans the whole slot
    stage = compute.decode_block(1, length, 1) + max(compute.embed_forward(1), compute.head_forward(1, 1))
    assert graphs["graph_capture_seconds"] == pytest.approx(2 * 2 * stage, rel=1e-12)
    assert "graph_capture_seconds" not in eager
    # more micro-groups than stages: one graph per group on each stage, each over its group's rows
    for groups, rows in ((2, 2), (3, 1)):  # 3 sequences in 2 or 3 groups
        est = Estimator(h100, engine=RestageEngine(RolloutLimits(pp_groups=groups)))
        got = parts(est.estimate(gen_mfc(3, 32, gen), role, layout))["graph_capture_seconds"]
        step = compute.decode_block(rows, length, 1) + max(compute.embed_forward(rows), compute.head_forward(rows, 1))
        assert got == pytest.approx(2 * groups * step, rel=1e-12), groups
    big = ModelRole("actor", preset("llama-7b"))
    engine = Estimator(h100, engine=RestageEngine(RolloutLimits(max_slots=64)))
    pinned = {Strategy(): 1.9677449785095078, Strategy(tp=2): 1.3754594087190903}
    for strategy, seconds in pinned.items():
        assert engine.estimate(gen_mfc(64, 128, 128), big, Layout.contiguous(0, strategy)).seconds == seconds
    pp2 = engine.estimate(gen_mfc(64, 128, 128), big, Layout.contiguous(0, Strategy(pp=2)))
    assert pp2.seconds < 0.5 * 5.3166828795019665  # eager micro-groups, as costed before: now replayed


def test_one_batch_engine_decodes_every_request_at_once_with_its_whole_kv(h100):
    """DeepSpeed-Chat's Hybrid Engine (peer_engines): the whole batch's KV cache, one round, every prompt whole."""
    cfg = preset("llama-7b")
    role, est = ModelRole("actor", cfg), Estimator(h100)
    compute = est.compute_for(role)
    mfc = gen_mfc(64, 128, 256)
    got = est.estimate(mfc, role, one_rank(), engine=OneBatchEngine())
    kv_token = 2 * 32 * 4096 * 2
    step = 32 * compute.decode_block(64, 128 + 257 / 2, 1) + compute.embed_forward(64) + compute.head_forward(64, 1)
    assert parts(got)["decode_seconds"] == pytest.approx(256 * step, rel=1e-12)
    assert got.transient_bytes >= 64 * (128 + 256) * kv_token
    assert parts(got)["prefill_seconds"] == pytest.approx(
        32 * compute.block_prefill(64, 128, 1) + compute.embed_forward(64 * 128) + compute.head_forward(64, 1), rel=1e-12)


def test_the_planner_costs_the_engine_the_config_builds():
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=64, gen=128,
                                       generation={"max_new_tokens": 128, "kv_cache_gib": 3, "max_slots": 8,
                                                   "cuda_graphs": False}))
    assert problem.estimator.engine == RestageEngine(RolloutLimits(kv_cache_bytes=3 * GIB, max_slots=8),
                                                     cuda_graphs=False)
    est = problem.candidate("actor_gen", one_rank()).estimate
    kv_token = 2 * 32 * 4096 * 2
    slots = min(8, 3 * GIB // (kv_token * (128 + 128)))
    assert slots == 8 and math.ceil(64 / slots) == 8
    mfc = problem.graph["actor_gen"]
    eight = problem.estimator.estimate(dataclasses.replace(mfc, n_seqs=8), problem.role(mfc), one_rank())
    assert parts(est)["decode_seconds"] == pytest.approx(8 * parts(eight)["decode_seconds"], rel=1e-12)


def _in_place_actor_gen(memory_gib: float | None = None):
    """PPO of two llama-7b models trained at ZeRO-3, every MFC on all 8 GPUs: the actor generates in place."""
    cluster = load_cluster("h100-80gb")
    if memory_gib is not None:
        cluster = dataclasses.replace(cluster, memory_bytes=int(memory_gib * GIB))
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=64, gen=128, zero=3), cluster=cluster)
    whole = Layout.contiguous(0, Strategy(dp=8))
    plan = tuple(problem.candidate(m, whole) for m in problem.mfcs)
    gen = problem.graph["actor_gen"]
    assert zero3_in_place(problem, plan, gen)
    seconds = dict((op.mfc, s) for op, s in plan_program(problem, plan) if isinstance(op, Run))
    held = max(_home_state_bytes(problem, plan, r) for r in whole.mesh)
    return problem, plan, gen, whole, seconds["actor_gen"], problem.capacity_bytes - held


def test_generation_gathered_once_on_its_zero3_training_layout_decodes_a_plain_copy():
    """The stage's 12.6 GiB fit in 60% of what the four models' states leave of 72 GiB: the runtime gathers them once
    into a plain copy (``runtime/store/zero3_generation.py``), which decodes as any copy (CUDA graphs), plus one gather."""
    problem, plan, gen, whole, seconds, left = _in_place_actor_gen()
    role, cand = problem.role(gen), plan[problem.index["actor_gen"]]
    assert cand.estimate.param_bytes <= GATHER_ONCE_FRACTION * left
    assert zero3_generation_mode(problem, plan, gen) == "gather_once"
    gather = zero3_gather_seconds(role.arch, whole, role.bytes_per_element, problem.cluster)
    assert seconds == pytest.approx(cand.seconds + gather, rel=1e-12)
    eager = problem.estimator.estimate(gen, role, whole, engine=RestageEngine(cuda_graphs=False)).seconds
    launches = 32 * (problem.cluster.block_overhead_seconds - GRAPH_BLOCK_SECONDS)
    assert cand.seconds < eager - 128 * 0.5 * launches  # the graphs' candidate: at least half the launch time saved
    assert zero3_in_place_bytes(problem, plan, gen) == cand.estimate.param_bytes  # the copy is counted whole


def test_generation_in_lockstep_on_its_zero3_training_layout_gathers_in_every_forward():
    """With 75 GB devices the copy no longer fits: the replicas step in lockstep over the partitions, decoding
    eagerly, and every forward gathers the stage: 128 decode steps and one prefill or join per check of 4 steps."""
    problem, plan, gen, whole, seconds, left = _in_place_actor_gen(memory_gib=75)
    role, cand = problem.role(gen), plan[problem.index["actor_gen"]]
    assert cand.estimate.param_bytes > GATHER_ONCE_FRACTION * left
    assert zero3_generation_mode(problem, plan, gen) == "lockstep"
    engine = problem.estimator.engine
    forwards = lockstep_forwards(problem.cluster, engine, gen, role, whole)
    assert forwards == 128 + 128 // engine.limits.check_every_steps  # 8 answers a rank, all in slots at once
    eager = problem.estimator.estimate(gen, role, whole, engine=RestageEngine(cuda_graphs=False)).seconds
    gather = zero3_gather_seconds(role.arch, whole, role.bytes_per_element, problem.cluster)
    assert seconds == pytest.approx(eager + forwards * gather, rel=1e-12)
    assert zero3_in_place_bytes(problem, plan, gen) == cand.estimate.param_bytes // 32  # one of its 32 layers at a time


def test_pipelined_generation_costs_micro_groups_through_busy_stages(h100):
    """pp = 2 (16 layers a stage): a token of 64 live slots is 2 ticks of every stage stepping 32 slots (the runtime's
    default, ``pp_groups`` None), against 2 stage steps over all 64 one after another (``pp_groups=1``)."""
    cfg = preset("llama-7b")
    role, mfc, layout = ModelRole("actor", cfg), gen_mfc(64, 128, 128), Layout.contiguous(0, Strategy(pp=2))
    pipelined, serial = (Estimator(h100, engine=RestageEngine(RolloutLimits(max_slots=64, pp_groups=g, paged=False),
                                                              cuda_graphs=False))  # both eager: the same block costs
                         for g in (None, 1))
    compute = pipelined.compute_for(role)
    attended = 128 + 129 / 2  # eager: the average filled cache

    def stage(batch):  # the slower of the two stages: 16 blocks plus the embedding, or 16 blocks plus the head
        blocks = 16 * compute.decode_block(batch, attended, 1)
        return blocks + max(compute.embed_forward(batch), compute.head_forward(batch, 1))

    got, want = (parts(e.estimate(mfc, role, layout)) for e in (pipelined, serial))
    # one round of 128 steps; the prefill is the same
    assert got["compute_seconds"] - want["compute_seconds"] == pytest.approx(128 * 2 * (stage(32) - stage(64)), rel=1e-9)
    assert got["prefill_seconds"] == want["prefill_seconds"]
    with pytest.raises(ConfigError, match="pp_groups=3 under pp=4"):  # the runtime's own rule on the group count
        Estimator(h100, engine=RestageEngine(RolloutLimits(pp_groups=3))).estimate(
            mfc, role, Layout.contiguous(0, Strategy(pp=4)))
