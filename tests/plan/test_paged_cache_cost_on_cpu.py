"""restage's rollout engine on its paged KV cache as the estimator costs it (``engines.paged_occupancy``,
``estimator._generate``): rows over a pool of blocks, concurrency from the blocks a request holds, a group's prompt
blocks held once, the first wave's preemption, attention by flash-attn or a gather of blocks. Each expected figure is
built here from the block arithmetic; the contiguous cache keeps its cost (``test_rollout_cost_on_cpu.py``)."""

import math
import sys
from pathlib import Path

import pytest

from restage.cluster import load_cluster
from restage.graph import MFC, MFCOptions
from restage.layout import Layout, Strategy
from restage.models.attention import flash_attn_with_kvcache
from restage.models.presets import preset
from restage.plan.estimator import Estimator
from restage.plan.generation_cost import (
    RestageEngine,
    block_tokens,
    paged_flash,
    paged_occupancy,
    paged_triton,
    replays_graphs,
)
from restage.plan.planner import build_problem, engine_of
from restage.plan.roles import ModelRole
from restage.plan.rollout_cost import restage_occupancy
from restage.rollout.budget import RolloutLimits

sys.path.insert(0, str(Path(__file__).parent))
from plan_helpers import ppo_config  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
KV_TOKEN = 2 * 32 * 4096 * 2  # llama-7b: K and V of 32 layers, 4096 wide, bf16: 512 KiB a token
BLOCK = 16 * KV_TOKEN  # 8 MiB


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


def paged(**limits):
    return RestageEngine(RolloutLimits(paged=True, **limits))


def test_concurrency_is_the_pool_over_the_blocks_a_request_holds_on_average(h100):
    """4 GiB of 8 MiB blocks: 512. A request of 128 + 128 tokens holds ceil((127 + t) / 16) blocks at step t:
    8 at t = 1, 9 for the next 16 steps, ..., 15, then 16 for the last 15: 1,592 over 128 steps, 12.4375 on
    average, so 41 decode at once; contiguous slots of 256 tokens (128 MiB) give 32."""
    assert 8 + 16 * sum(range(9, 16)) + 15 * 16 == 1592
    occ = paged_occupancy(4 * GIB, KV_TOKEN, 128, 128, 1, 512, 512, 16)
    assert occ.mean_blocks == 1592 / 128
    assert occ.live == math.floor(512 / (1592 / 128)) == 41
    assert occ.cache_bytes == (512 + 1) * BLOCK  # the pool and its scratch block
    role = ModelRole("actor", preset("llama-7b"))
    mfc = gen_mfc(512, 128, 128)
    engine = paged(kv_cache_bytes=4 * GIB, max_slots=512)
    assert restage_occupancy(h100, engine, mfc, role, one_rank()) == occ
    contiguous = RestageEngine(RolloutLimits(kv_cache_bytes=4 * GIB, max_slots=512, paged=False))
    assert restage_occupancy(h100, contiguous, mfc, role, one_rank()).live == 4 * GIB // (256 * KV_TOKEN) == 32
    # The pool is never larger than every row's max_len: 8 rows of 16 blocks
    assert paged_occupancy(4 * GIB, KV_TOKEN, 128, 128, 1, 8, 512, 16).cache_bytes == (8 * 16 + 1) * BLOCK
    # ... and the rows are min(max_slots, requests), whatever the pool holds
    assert paged_occupancy(4 * GIB, KV_TOKEN, 128, 128, 1, 512, 24, 16).live == 24


def test_a_group_holds_its_prompt_blocks_once(h100):
    """8 siblings of a 512-token prompt in 16-token blocks: its 511 cached tokens fill 31 full blocks, held once for
    the group (31 / 8 a sibling) instead of once a sibling; each sibling copies only the 15 tokens of the last."""
    alone, grouped = (paged_occupancy(64 * GIB, KV_TOKEN, 512, 128, group, 64, 64, 16) for group in (1, 8))
    assert alone.mean_blocks == sum(math.ceil((511 + t) / 16) for t in range(1, 129)) / 128
    assert grouped.mean_blocks == pytest.approx(alone.mean_blocks - 31 + 31 / 8, rel=1e-12)
    role, est = ModelRole("actor", preset("llama-7b")), Estimator(h100, engine=paged())
    got = parts(est.estimate(gen_mfc(64, 512, 128, group=8), role, one_rank()))
    copy = 2 * 56 * (511 % 16) * KV_TOKEN / h100.achievable_memory_bandwidth()  # 56 siblings, read + write
    assert got["kv_copy_seconds"] == pytest.approx(copy, rel=1e-12)


def test_no_preemption_when_the_pool_holds_every_first_wave_request_whole(h100):
    occ = paged_occupancy(64 * GIB, KV_TOKEN, 128, 896, 1, 64, 64, 16)
    assert (occ.preempted, occ.lost_steps) == (0, 0.0)
    est = Estimator(h100, engine=paged(kv_cache_bytes=64 * GIB)).estimate(gen_mfc(64, 128, 896), ModelRole(
        "actor", preset("llama-7b")), one_rank())
    assert "preemption_seconds" not in parts(est)


def test_the_first_wave_preempts_what_the_pool_cannot_hold_and_does_it_again(h100):
    """9 blocks of 16 tokens, 4 requests of 17 + 32 tokens: all 4 are admitted (2 blocks each for 17 tokens) and hold
    2 blocks for steps 1-16, 3 for steps 17-32; at step 17 the pool holds 3 of them, so the newest is preempted
    after its 16 steps. On average a request holds 2.5 blocks: 3 decode at once."""
    occ = paged_occupancy(9 * BLOCK, KV_TOKEN, 17, 32, 1, 4, 4, 16)
    assert (occ.live, occ.mean_blocks, occ.preempted, occ.lost_steps) == (3, 2.5, 1, 16.0)
    role = ModelRole("actor", preset("llama-7b"))
    got = parts(Estimator(h100, engine=paged(kv_cache_bytes=9 * BLOCK, max_slots=4)).estimate(
        gen_mfc(4, 17, 32), role, one_rank()))
    step = got["decode_seconds"] / (2 * 32)  # ceil(4 / 3) = 2 rounds of 32 steps
    prefill_one = got["prefill_seconds"] / 4  # the 4 prompts' prefill, one of them again
    assert got["preemption_seconds"] == pytest.approx(16 / 3 * step + prefill_one, rel=1e-9)


def test_attention_reads_what_flash_reads_or_a_gather_of_blocks(h100):
    """flash-attn (256-token blocks) reads each row's own tokens, as it does from contiguous slots; SDPA on a paged
    cache first gathers every row's blocks into the whole slot in each stage step (a graph's span)."""
    role, mfc = ModelRole("actor", preset("llama-7b")), gen_mfc(16, 128, 128)
    budget = dict(kv_cache_bytes=16 * GIB)  # every answer fits at once either way: same live, no preemption
    flash_paged, flash_slots = (Estimator(h100, engine=RestageEngine(RolloutLimits(paged=p, **budget), flash_attn=True))
                                for p in (True, False))
    a, b = (parts(e.estimate(mfc, role, one_rank())) for e in (flash_paged, flash_slots))
    assert a["decode_seconds"] == b["decode_seconds"] and "kv_gather_seconds" not in a
    gathered, slots = (Estimator(h100, engine=RestageEngine(RolloutLimits(paged=p, **budget))) for p in (True, False))
    a, b = (parts(e.estimate(mfc, role, one_rank())) for e in (gathered, slots))
    # 128 steps of 16 rows, each reading its own 128 + 129 / 2 tokens on average and writing 256 positions
    gather = 128 * 16 * (128 + 129 / 2 + 256) * KV_TOKEN / h100.achievable_memory_bandwidth()
    assert a["kv_gather_seconds"] == pytest.approx(gather, rel=1e-12)
    assert a["decode_seconds"] - b["decode_seconds"] == pytest.approx(gather, rel=1e-9)


def test_the_triton_kernel_reads_in_place_in_blocks_of_16_without_a_gather(h100):
    """kv_cache: paged on a GPU without flash-attn, triton installed: 16-token blocks (not flash-attn's 256), each row
    read to its own length (as flash-attn does), so no gather: the same decode seconds as flash-attn's paged kernel
    (every answer fits at once either way: 16 live rows), where the gather path adds 128 steps of 16 rows each reading
    its own 128 + 129 / 2 tokens and writing 256 positions."""
    role, mfc = ModelRole("actor", preset("llama-7b")), gen_mfc(16, 128, 128)
    limits = RolloutLimits(paged=True, kv_cache_bytes=16 * GIB)
    triton, flash, gathered = (RestageEngine(limits, triton=True), RestageEngine(limits, flash_attn=True),
                               RestageEngine(limits))
    assert paged_triton(h100, triton, "bf16", 128) and not paged_flash(h100, triton, "bf16")
    assert block_tokens(h100, triton, "bf16") == 16 and block_tokens(h100, flash, "bf16") == 256
    occ = restage_occupancy(h100, triton, mfc, role, one_rank())
    assert occ.block_tokens == 16 and occ.live == 16
    assert occ.cache_bytes == (16 * 16 + 1) * BLOCK  # 16 rows of 256 tokens in 16-token blocks, and the scratch
    t, f, g = (parts(Estimator(h100, engine=e).estimate(mfc, role, one_rank())) for e in (triton, flash, gathered))
    assert "kv_gather_seconds" not in t and t["decode_seconds"] == f["decode_seconds"]
    gather = 128 * 16 * (128 + 129 / 2 + 256) * KV_TOKEN / h100.achievable_memory_bandwidth()
    assert g["kv_gather_seconds"] == pytest.approx(gather, rel=1e-12)
    # The gather path also attends the whole slot in a graph (SDPA over the gathered span), as contiguous slots do
    # under SDPA; the kernel attends each row's filled prefix: less than the gather path less its gather.
    slots = parts(Estimator(h100, engine=RestageEngine(RolloutLimits(paged=False, kv_cache_bytes=16 * GIB))).estimate(
        mfc, role, one_rank()))
    assert g["decode_seconds"] - gather == pytest.approx(slots["decode_seconds"], rel=1e-9)
    assert t["decode_seconds"] < slots["decode_seconds"]
    # Not served: a CPU, a head dim that is not a power of two, flash-attn's own paged kernel (256-token blocks)
    assert not paged_triton(load_cluster("local-cpu"), triton, "fp32", 128)
    assert not paged_triton(h100, triton, "bf16", 24)
    assert not paged_triton(h100, RestageEngine(limits, flash_attn=True, triton=True), "bf16", 128)
    assert paged_triton(h100, RestageEngine(limits, flash_attn=True, triton=True), "fp32", 128)  # flash: half only


def test_the_planner_takes_triton_only_where_a_paged_cache_is_asked_for():
    generation = {"max_new_tokens": 128, "kv_cache_gib": 3, "max_slots": 8}
    for kv_cache, expected in (("paged", True), ("auto", False), ("contiguous", False)):
        cfg = ppo_config("llama-7b", "llama-7b", batch=64, gen=128, generation=generation | {"kv_cache": kv_cache})
        assert engine_of(cfg, flash_attn=False, triton=True).triton is expected
        assert not engine_of(cfg, flash_attn=False, triton=False).triton


def test_block_size_and_graphs_as_the_runtime_chooses_them(h100):
    cfg = preset("llama-7b")
    assert block_tokens(h100, RestageEngine(flash_attn=True), "bf16") == 256  # flash-attn's paged kernel
    assert block_tokens(h100, RestageEngine(flash_attn=True), "fp32") == 16  # flash-attn serves half precision only
    assert block_tokens(h100, RestageEngine(), "bf16") == 16
    assert block_tokens(load_cluster("local-cpu"), RestageEngine(flash_attn=True), "fp32") == 16
    assert block_tokens(h100, RestageEngine(RolloutLimits(block_tokens=64), flash_attn=True), "bf16") == 64
    # under pp each stage replays a graph per micro-group and bucket (pipelined.py); pp_groups=1 (the stages one
    # after another, each receiving and sending inside its step) decodes eagerly
    assert replays_graphs(h100, RestageEngine(), cfg, Strategy(pp=2), groups=2)
    assert not replays_graphs(h100, RestageEngine(), cfg, Strategy(pp=2), groups=1)
    assert replays_graphs(h100, RestageEngine(), cfg, Strategy(), groups=1)


def test_the_planner_builds_the_cache_the_config_asks_for():
    generation = {"max_new_tokens": 128, "kv_cache_gib": 3, "max_slots": 8}
    default = build_problem(ppo_config("llama-7b", "llama-7b", batch=64, gen=128, generation=generation))
    assert default.estimator.engine == RestageEngine(RolloutLimits(kv_cache_bytes=3 * GIB, max_slots=8),
                                                     flash_attn=flash_attn_with_kvcache is not None)
    cfg = ppo_config("llama-7b", "llama-7b", batch=64, gen=128,
                     generation=generation | {"kv_cache": "contiguous", "kv_block_tokens": 32})
    engine = engine_of(cfg, flash_attn=True)
    assert engine.limits == RolloutLimits(kv_cache_bytes=3 * GIB, max_slots=8, paged=False, block_tokens=32)
    assert engine.flash_attn
