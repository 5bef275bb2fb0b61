"""The planner's view of expert parallelism: ep candidates for MoE models only, experts/ep of the memory, the two
all-to-alls per sparse layer on the ep group's link, and the one-line refusals of the feasibility rule."""

import dataclasses

import pytest

from restage.cluster import load_cluster
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.flops import block_shape
from restage.models.presets import preset
from restage.models.sharding import layout_problem
from restage.plan.compute import RooflineCompute
from restage.plan.estimator import Estimator
from restage.plan.layout_cost import expert_exchange_seconds
from restage.plan.problem import strategies_for
from restage.plan.roles import ModelRole

GEN = MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs",), 64, 128, 256)
INF = MFC("ref_inf", "inference", "actor", ("seqs",), ("ref_logprobs",), 64, 128, 256)
TRAIN = MFC("actor_train", "train_step", "actor", ("seqs",), (), 64, 128, 256, micro_batches=4)


def role(arch="mixtral-8x7b", zero_stage=0):
    return ModelRole("actor", preset(arch), dtype="bf16", trainable=True, zero_stage=zero_stage)


def estimate(mfc, strategy, r=None, nodes=2):
    cluster = load_cluster("h100-80gb", nodes=nodes)
    return Estimator(cluster, use_profiles=False).estimate(mfc, r or role(), Layout.contiguous(0, strategy))


def test_candidates_gain_ep_for_a_moe_model_only():
    cluster = load_cluster("h100-80gb", nodes=1)
    moe = strategies_for(8, role(), INF, cluster)
    assert {s.ep for s in moe} == {1, 2, 4, 8}
    assert all(s.dp % s.ep == 0 and 8 % s.ep == 0 for s in moe)
    assert Strategy(dp=8, ep=8) in moe and Strategy(dp=4, tp=2, ep=4) in moe
    dense = strategies_for(8, role("llama-7b"), INF, cluster)
    assert {s.ep for s in dense} == {1}
    # a train step takes ep with ZeRO 0-2 (runtime/store/expert_engine.py); ZeRO-3 takes no expert groups
    assert {s.ep for s in strategies_for(8, role(zero_stage=0), TRAIN, cluster)} == {1, 2, 4, 8}
    assert {s.ep for s in strategies_for(8, role(zero_stage=2), TRAIN, cluster)} == {1, 2, 4, 8}
    assert {s.ep for s in strategies_for(8, role(zero_stage=3), TRAIN, cluster)} == {1}


def test_ep_divides_the_expert_memory_and_costs_two_all_to_alls_per_sparse_layer():
    cfg = preset("mixtral-8x7b")
    one, two, eight = (estimate(INF, Strategy(dp=8, ep=ep)) for ep in (1, 2, 8))
    experts = sum(3 * cfg.hidden_size * cfg.moe_intermediate_size for _ in range(cfg.num_experts)) * cfg.num_layers
    assert one.param_bytes - two.param_bytes == experts // 2 * 2  # half the experts gone, 2 bytes each (bf16)
    assert one.param_bytes - eight.param_bytes == experts * 7 // 8 * 2
    assert one.part("ep_comm_seconds") == 0 and two.part("ep_comm_seconds") > 0
    cluster = load_cluster("h100-80gb", nodes=2)
    tokens = 64 / 8 * 384 / one.micro_batches  # sequences per rank x (prompt + answer) per micro-batch
    bandwidth, latency = cluster.link((0, 1))
    per_exchange = 0.5 * tokens * cfg.hidden_size * cfg.experts_per_token * 2 / bandwidth + latency
    layout = Layout.contiguous(0, Strategy(dp=8, ep=2))
    assert expert_exchange_seconds(cluster, cfg, layout, tokens, 2) == pytest.approx(cfg.num_layers * 2 * per_exchange)


def test_an_ep_group_across_nodes_pays_the_inter_node_link():
    # 16 ranks on 2 nodes of 8: ep=16 spans both nodes, ep=8 stays inside one
    r = role("qwen3-30b-a3b")  # 128 experts
    inside, across = (estimate(GEN, Strategy(dp=16, ep=ep), r).part("ep_comm_seconds") for ep in (8, 16))
    cluster = load_cluster("h100-80gb", nodes=2)
    assert cluster.link(tuple(range(16)))[0] < cluster.link(tuple(range(8)))[0]
    assert across > inside > 0


def test_bad_ep_is_refused_in_one_line_naming_what_to_change():
    moe, dense = preset("mixtral-8x7b"), preset("llama-7b")
    problem = layout_problem("actor", dense, Strategy(dp=2, ep=2), 8)
    assert problem == "models.actor: ep=2 needs a mixture-of-experts model and this one is dense; use ep=1"
    odd = dataclasses.replace(moe, num_experts=6)
    assert layout_problem("actor", odd, Strategy(dp=4, ep=4), 8) == (
        "models.actor: ep=4 does not divide its 6 experts; use ep in [1, 2]")
    trained = layout_problem("actor", moe, Strategy(dp=2, ep=2), 2, trained=True, zero_stage=3)
    assert trained is not None and "set zero_stage=2 or train with ep=1" in trained and "\n" not in trained
    assert all(layout_problem("actor", moe, Strategy(dp=2, ep=2), 8, trained=True, zero_stage=z) is None
               for z in (0, 1, 2))
    assert layout_problem("actor", moe, Strategy(dp=2, ep=2), 8) is None


def test_training_under_ep_reduces_expert_gradients_over_the_expert_dp_group():
    from restage.plan.comm import allgather_seconds, reduce_scatter_seconds
    from restage.plan.model_state import stage_expert_elements, stage_param_elements

    cfg, cluster = preset("mixtral-8x7b"), load_cluster("h100-80gb", nodes=2)
    r = role(zero_stage=1)
    for ep in (2, 8):
        strategy = Strategy(dp=16, ep=ep)
        layout = Layout.contiguous(0, strategy)
        params, experts = stage_param_elements(cfg, 1, 1, ep)[0], stage_expert_elements(cfg, 1, 1, ep)[0]
        assert experts == stage_expert_elements(cfg, 1, 1)[0] // ep > 0
        edp = layout.edp_groups()[0]
        assert len(edp) == 16 // ep
        expected = sum(reduce_scatter_seconds(cluster, group, n * 2) + allgather_seconds(cluster, group, n * 2)
                       for group, n in ((tuple(range(16)), params - experts), (edp, experts)))
        got = estimate(TRAIN, strategy, r).part("dp_comm_seconds") / TRAIN.minibatches
        assert got == pytest.approx(expected)
    # ZeRO partitions the experts' optimizer state over dp / ep ranks, not dp: more state per rank than ep=1 would
    # suggest after dividing the experts by ep, and ZeRO-0 trains as ZeRO-1 under ep
    zero0, zero1 = (estimate(TRAIN, Strategy(dp=16, ep=8), role(zero_stage=z)) for z in (0, 1))
    assert zero0.state_bytes == zero1.state_bytes


def test_expert_gemms_read_only_the_experts_routed_to_and_ep_divides_them():
    cfg = preset("mixtral-8x7b")  # 8 experts, top 2, every layer sparse
    compute = RooflineCompute(load_cluster("h100-80gb", nodes=1), cfg, "bf16")
    s = block_shape(cfg, 1)
    dense = s.weight_params - s.expert_params
    assert s.expert_params == 8 * 3 * 14336 * 4096
    # one token reads its 2 experts of 8; a long prompt reads all 8; ep2 holds 4 and its group routes 2 tokens
    assert compute._weight_elements(s, 1, 1) == pytest.approx(dense + s.expert_params * 2 / 8)
    assert compute._weight_elements(s, 4096, 1) == pytest.approx(dense + s.expert_params)
    assert compute._weight_elements(s, 1, 2) == pytest.approx(dense + s.expert_params / 2 * (1 - (6 / 8) ** 2))
    # a decode step is memory-bound: ep2 reads fewer weights per rank; a long prefill is FLOP-bound: ep changes nothing
    assert compute.decode_block(64, 512, 1, ep=2) < 0.8 * compute.decode_block(64, 512, 1, ep=1)
    assert compute.block_forward(8, 4096, 1, ep=2) == pytest.approx(compute.block_forward(8, 4096, 1, ep=1))
