"""bench/cross_system.py builds the published comparisons' work as stated, its ratio arithmetic is right, and the
peers' critic forward on a ZeRO-3 engine gathers layer by layer, and DeepSpeed-Chat's Hybrid Engine generates in
its batches, gathering the actor each call (issue 30 item 4)."""

import pytest
from plan_helpers import ppo_config

from restage.graph import MFCKind
from restage.layout import Layout, Strategy
from restage.plan.model_state import stage_param_elements
from restage.plan.peers.defaults import _with_stage, deepspeed_chat, derived
from restage.plan.peers.peer_engines import HybridEngine, waves_estimate
from restage.plan.planner import build_problem
from restage.plan.transfer_cost import zero3_gather_seconds


@pytest.fixture(scope="module")
def cross_system(bench_module):
    return bench_module("cross_system"), bench_module("validation_set")


def test_work_matches_each_entry(cross_system):
    cs, vs = cross_system
    per_size = [e for e in vs.CROSS_SYSTEM if e.gpus is not None]
    assert [(e.params_b, e.gpus) for e in per_size] == [(7, 16), (13, 32), (34, 32), (70, 32)]
    for entry in per_size:
        problem = cs.problem_of(cs.work_of(entry))
        assert problem.cluster.world_size == entry.gpus
        assert problem.cluster.intra_node_bandwidth_bytes_per_second == 200e9  # A800: NVLink 200 GB/s each way
        assert problem.samples_per_iteration == 1024
        gen = next(m for m in problem.mfcs if m.kind is MFCKind.GENERATE)
        assert (gen.n_seqs, gen.prompt_tokens, gen.gen_tokens) == (1024, 1024, 1024)
        assert {m.minibatches for m in problem.mfcs if m.kind is MFCKind.TRAIN_STEP} == {8}
        assert sorted(problem.roles) == ["actor", "critic", "ref", "reward"]
        for name, role in problem.roles.items():  # every model the actor's size, within 8% of the entry's
            billions = sum(stage_param_elements(role.arch, 1, 1)) / 1e9
            assert abs(billions / entry.params_b - 1) < 0.08, (entry.name, name, billions)
            assert role.offload_optimizer == role.trainable  # the README: Adam on the host for both systems


def test_ratio_arithmetic_by_hand(cross_system):
    cs, _ = cross_system
    seconds = {"deepspeed-chat": 855.09, "openrlhf": 471.11}  # the README's 7B row
    ratio = cs.modelled_ratio("openrlhf/deepspeed-chat", seconds)
    assert ratio == pytest.approx(1.81505, abs=1e-5)  # 855.09 / 471.11
    assert cs.ratio_error(ratio, 1.82) == pytest.approx(1.81505 / 1.82 - 1, abs=1e-5)  # -0.27%
    assert cs.ratio_error(1.17, 1.82) == pytest.approx(-0.35714, abs=1e-5)
    assert cs.ordering_holds(("openrlhf", "deepspeed-chat"), seconds)
    assert not cs.ordering_holds(("deepspeed-chat", "openrlhf"), seconds)


def test_entry_row_is_consistent_with_its_seconds(cross_system):
    cs, vs = cross_system
    row = cs.check_entry(vs.CROSS_SYSTEM[0])
    s = {k: v["seconds"] for k, v in row["systems"].items()}
    peer, era = row["ratios"]
    assert peer["ratio"] == "openrlhf/deepspeed-chat" and era["ratio"] == "openrlhf_2024/deepspeed-chat"
    assert peer["modelled"] == pytest.approx(s["deepspeed-chat"] / s["openrlhf"])
    assert era["modelled"] == pytest.approx(s["deepspeed-chat"] / s["openrlhf_2024"])
    assert peer["error"] == pytest.approx(peer["modelled"] / 1.82 - 1)
    assert row["ordering_held"] == (s["openrlhf"] < s["deepspeed-chat"])


def test_critic_forward_on_zero3_engine_gathers_layer_by_layer():
    """DeepSpeed ZeRO-3's module hooks (and FSDP's units) fetch one layer at a time: the critic's inference on
    its training layout holds its 1/dp partition, not a gathered copy of the whole model."""
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=256, gen=128, zero=3))
    peer = derived(problem, _with_stage(3, shard_frozen=True))
    critic_inf = next(m for m in peer.mfcs if m.model == "critic" and m.kind is MFCKind.INFERENCE)
    role = peer.role(critic_inf)
    assert (role.trainable, role.shard_frozen, role.prefetch_gathers) == (False, True, True)
    layout = Layout.contiguous(0, Strategy(dp=8))
    est = peer.candidate(critic_inf, layout).estimate
    params = sum(stage_param_elements(problem.roles["critic"].arch, 1, 1))
    assert est.param_bytes == pytest.approx(params * 2 / 8, rel=0.01)  # bf16 partition of 8
    assert restage_param_bytes(problem, critic_inf, layout) == pytest.approx(params * 2, rel=0.01)  # restage: whole
    train = next(m for m in peer.mfcs if m.model == "critic" and m.kind is MFCKind.TRAIN_STEP)
    assert peer.role(train).trainable  # the train step keeps the trained role


def test_zero1_critic_keeps_its_role():
    """NeMo-Aligner's distributed optimizer (ZeRO-1) holds whole parameters: nothing to gather."""
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=256, gen=128, zero=1))
    peer = derived(problem, _with_stage(1))
    critic_inf = next(m for m in peer.mfcs if m.model == "critic" and m.kind is MFCKind.INFERENCE)
    assert peer.role(critic_inf) == peer.roles["critic"]


def restage_param_bytes(problem, mfc, layout):
    return problem.candidate(mfc, layout).estimate.param_bytes


def test_hybrid_engine_waves_follow_the_generation_batch():
    """DeepSpeed-Chat takes a rank's prompts --per_device_generation_batch_size at a time; smaller batches (more
    waves) only as fallbacks, never a larger batch than the setting."""
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=512, gen=128, zero=3))
    gen = next(m for m in problem.mfcs if m.kind is MFCKind.GENERATE)
    # 512 prompts on dp 8: 64 a rank
    assert HybridEngine(batch_per_device=8).waves(gen, 8) == [8, 16, 32, 64]
    assert HybridEngine(batch_per_device=16).waves(gen, 8) == [4, 8, 16, 32, 64]
    assert HybridEngine(batch_per_device=100).waves(gen, 8) == [1, 2, 4, 8, 16, 32, 64]
    assert HybridEngine(batch_per_device=24).waves(gen, 8) == [3, 6, 12, 24, 48]  # ceil(64 / 24) = 3


def test_hybrid_engine_gathers_the_zero3_actor_once_per_call():
    """Each generate call of DeepSpeed's Hybrid Engine gathers the whole ZeRO-3 actor: w waves cost w - 1 gathers
    over the generation's ranks on top of the waves themselves (the plan's evaluation adds the first)."""
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=512, gen=128, zero=3))
    gen = next(m for m in problem.mfcs if m.kind is MFCKind.GENERATE)
    peer = derived(problem, _with_stage(3, shard_frozen=True), HybridEngine(batch_per_device=8))
    layout = Layout.contiguous(0, Strategy(dp=8))
    gather = zero3_gather_seconds(peer.roles["actor"].arch, layout, 2, peer.cluster)
    assert gather > 0
    for waves in (1, 8, 16):
        est = peer.candidate(gen, layout, waves).estimate
        plain = waves_estimate(peer, gen, layout, waves)
        assert est.seconds == pytest.approx(plain.seconds + (waves - 1) * gather, rel=1e-12)
    assert peer.candidate(gen, layout).micro_batches == 8  # no count given: the batch's waves
    tp2 = Layout.contiguous(0, Strategy(dp=4, tp=2))  # --inference_tp_size 2: still the whole model, over all 8 ranks
    est = peer.candidate(gen, tp2, 16).estimate
    assert est.seconds == pytest.approx(waves_estimate(peer, gen, tp2, 16).seconds + 15 * gather, rel=1e-12)
    assert [c.micro_batches for c in peer.options(gen, layout)] == [8, 16, 32, 64]  # the fewest waves fastest first


def test_hybrid_engine_without_zero3_does_not_regather():
    problem = build_problem(ppo_config("llama-7b", "llama-7b", batch=512, gen=128, zero=2))
    gen = next(m for m in problem.mfcs if m.kind is MFCKind.GENERATE)
    peer = derived(problem, _with_stage(2), HybridEngine(batch_per_device=8))
    layout = Layout.contiguous(0, Strategy(dp=8))
    assert peer.candidate(gen, layout, 8).estimate.seconds == pytest.approx(waves_estimate(peer, gen, layout, 8).seconds)


def test_deepspeed_chat_rule_generates_in_its_batches(cross_system):
    cs, vs = cross_system
    problem = cs.problem_of(cs.work_of(vs.CROSS_SYSTEM[0]))  # 1,024 prompts on 16 GPUs: 64 a rank
    plan, _ = deepspeed_chat(problem, cs.DSCHAT_ENGINE)
    gen = next(c for c in plan if c.mfc == "actor_gen")
    assert cs.DSCHAT_ENGINE.batch_per_device == 8
    assert (gen.layout.strategy.dp, gen.micro_batches) == (16, 8)
