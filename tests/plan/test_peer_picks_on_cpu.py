"""What each peer's rule picks for the paper's PPO configs (jobs/paper), layout by layout, and why."""

import dataclasses
from pathlib import Path

import pytest
from plan_helpers import ppo_config

from restage.config.load import load_config
from restage.plan.peers.defaults import BUILDERS, nemo_critic_sizes, openrlhf_arrangements
from restage.plan.planner import build_problem
from restage.plan.problem import PlanProblem

PAPER = Path(__file__).resolve().parents[2] / "jobs" / "paper"
ORDER = ("actor_gen", "reward_inf", "ref_inf", "critic_inf", "actor_train", "critic_train")


def colocated(world, gen_tp):
    return [f"[0-{world - 1}]dp{world // gen_tp}tp{gen_tp}pp1"] + [f"[0-{world - 1}]dp{world}tp1pp1"] * 5


# Per config and peer: the layouts of ORDER's MFCs. DeepSpeed-Chat and verl colocate everything data-parallel
# and raise only the generation's TP (DeepSpeed-Chat from 1, verl from its rule's 2); OpenRLHF's fastest
# arrangement (generation costed as its vLLM engines run): the hybrid engine on one node and at 34B, the paired
# groups at 13B and 70B; NeMo-Aligner's fastest power-of-two critic job: half a node for the 7B critic beside a
# 13B actor, at 34B and beside a 7B actor, two nodes (an eighth of the GPUs) beside the 70B actor (with the
# activations counted from the decoder's saved tensors, the splits with an 8-GPU critic need twice the micro-batches).
PICKS = {
    "7b-h100x8-gen128": {
        "deepspeed_chat": colocated(8, 1), "openrlhf": colocated(8, 1), "verl": colocated(8, 2),
        "nemo_aligner": ["[0-3]dp4tp1pp1", "[4-7]dp4tp1pp1", "[0-3]dp4tp1pp1", "[4-7]dp4tp1pp1", "[0-3]dp4tp1pp1",
                         "[4-7]dp4tp1pp1"]},
    "13b-h100x16-gen128": {
        "deepspeed_chat": colocated(16, 1), "verl": colocated(16, 2),
        "openrlhf": ["[11-15]dp5tp1pp1", "[6-10]dp5tp1pp1", "[0-5]dp6tp1pp1", "[6-10]dp5tp1pp1", "[0-5]dp6tp1pp1",
                     "[6-10]dp5tp1pp1"],
        "nemo_aligner": ["[0-11]dp6tp2pp1", "[12-15]dp4tp1pp1", "[0-11]dp6tp2pp1", "[12-15]dp4tp1pp1",
                         "[0-11]dp6tp2pp1", "[12-15]dp4tp1pp1"]},
    "34b-h100x32-gen128": {
        "deepspeed_chat": colocated(32, 2), "verl": colocated(32, 2),
        "openrlhf": colocated(32, 2),
        "nemo_aligner": ["[0-27]dp7tp4pp1", "[28-31]dp4tp1pp1", "[0-27]dp7tp4pp1", "[28-31]dp4tp1pp1",
                         "[0-27]dp7tp4pp1", "[28-31]dp4tp1pp1"]},
    "70b-h100x128-gen128": {
        "deepspeed_chat": colocated(128, 4), "verl": colocated(128, 4),
        "openrlhf": ["[86-127]dp21tp2pp1", "[43-85]dp43tp1pp1", "[0-42]dp43tp1pp1", "[43-85]dp43tp1pp1",
                     "[0-42]dp43tp1pp1", "[43-85]dp43tp1pp1"],
        "nemo_aligner": ["[0-111]dp14tp8pp1", "[112-127]dp16tp1pp1", "[0-111]dp14tp8pp1", "[112-127]dp16tp1pp1",
                         "[0-111]dp14tp8pp1", "[112-127]dp16tp1pp1"]},
}
OPENRLHF_ARRANGEMENT = {"7b-h100x8-gen128": "colocate_all_models", "13b-h100x16-gen128": "colocate_actor_ref+critic_reward",
                        "34b-h100x32-gen128": "colocate_all_models", "70b-h100x128-gen128": "colocate_actor_ref+critic_reward"}
NEMO_CRITIC_SIZES = {"7b-h100x8-gen128": [1, 2, 4], "13b-h100x16-gen128": [1, 2, 4, 8],
                     "34b-h100x32-gen128": [1, 2, 4, 8, 16], "70b-h100x128-gen128": [1, 2, 4, 8, 16, 32, 64]}


@pytest.fixture(scope="module", params=sorted(PICKS))
def config(request):
    return request.param, build_problem(load_config(PAPER / f"ppo-{request.param}.yaml"))


def test_each_peer_rule_picks_its_documented_layouts(config):
    name, problem = config
    for peer, expected in PICKS[name].items():
        plan, _ = BUILDERS[peer](problem)
        got = {c.mfc: str(c.layout) for c in plan}
        assert [got[m] for m in ORDER] == expected, (name, peer)


def test_openrlhf_and_nemo_aligner_pick_their_fastest_arrangement(config):
    name, problem = config
    arrangements = {k: v for k, v in openrlhf_arrangements(problem).items() if v is not None}
    fastest = min(arrangements, key=lambda k: arrangements[k][1].iteration_seconds)
    assert fastest == OPENRLHF_ARRANGEMENT[name]
    assert BUILDERS["openrlhf"](problem)[1].iteration_seconds == arrangements[fastest][1].iteration_seconds
    assert nemo_critic_sizes(problem) == NEMO_CRITIC_SIZES[name]
    nemo = BUILDERS["nemo_aligner"](problem)[0]
    critic_gpus = next(c.layout.size for c in nemo if c.mfc == "critic_train")
    assert critic_gpus in NEMO_CRITIC_SIZES[name]


def test_sharded_frozen_models_hold_one_dp_share_where_the_peer_shards_them(config):
    name, problem = config
    world = problem.cluster.world_size
    whole = {m: problem.candidate(m, plan_layout, 1).estimate.state_bytes
             for m, plan_layout in [("ref_inf", _layout(problem, "deepspeed_chat", "ref_inf"))]}
    for peer in ("deepspeed_chat", "verl"):
        ref = next(c for c in BUILDERS[peer](problem)[0] if c.mfc == "ref_inf")
        assert ref.estimate.state_bytes == whole["ref_inf"] // world  # ZeRO-3 / FSDP over all GPUs
    nemo_ref = next(c for c in BUILDERS["nemo_aligner"](problem)[0] if c.mfc == "ref_inf")
    assert nemo_ref.estimate.state_bytes == problem.candidate("ref_inf", nemo_ref.layout, 1).estimate.state_bytes


def _layout(problem, peer, mfc):
    return next(c.layout for c in BUILDERS[peer](problem)[0] if c.mfc == mfc)


def test_nemo_aligner_reshards_the_actors_pipeline_into_tensor_parallel_generation():
    # 7B actor and critic on 4 nodes of GPUs cut to 10 GiB: the actor job (16 GPUs) needs Megatron TP 8 x PP 2;
    # TensorRT-LLM generates with TP 16 and no pipeline (trainer.ppo.trt_llm.reshard).
    base = build_problem(ppo_config("llama-7b", "llama-7b", nodes=4, batch=64, gen=64, zero=1))
    problem = PlanProblem(base.graph, base.roles, dataclasses.replace(base.cluster, memory_bytes=10 * 2**30))
    got = {c.mfc: str(c.layout) for c in BUILDERS["nemo_aligner"](problem)[0]}
    assert got["actor_train"] == got["ref_inf"] == "[0-15]dp1tp8pp2"
    assert got["actor_gen"] == "[0-15]dp1tp16pp1"
    assert got["critic_train"] == got["critic_inf"] == got["reward_inf"] == "[16-31]dp1tp8pp2"
