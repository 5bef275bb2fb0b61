"""The published systems as they ran (bench/published.py) and the cost rules added for them.

Each expected figure is worked out here from the rule's parts: vLLM 0.3's per-step Ray cost at TP > 1
(vllm-project/vllm PR #3763) and the host-to-device copy of an offloaded ZeRO-3 partition per gather.
"""

import dataclasses
import sys
from pathlib import Path

import pytest

from restage.cluster import load_cluster
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.estimator import Estimator
from restage.plan.generation_cost import (
    VLLM_RAY_TP_STEP_SECONDS,
    VllmEngine,
    decode_rounds,
    ray_tp_step_seconds,
    vllm_generate_seconds,
)
from restage.plan.model_state import stage_param_elements
from restage.plan.roles import ModelRole

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def published():
    sys.path.insert(0, str(BENCH))
    try:
        import published
    finally:
        sys.path.remove(str(BENCH))
    return {p.name: p for p in published.POINTS}


def test_vllm_ray_tensor_parallel_costs_the_measured_step_difference_at_tp_above_one():
    assert VLLM_RAY_TP_STEP_SECONDS == pytest.approx(0.0036)  # (24.2 s - 17.0 s) / 2,000 steps
    assert [ray_tp_step_seconds(tp) for tp in (1, 2, 4)] == [0.0, pytest.approx(0.0036), pytest.approx(0.0036)]
    a800 = dataclasses.replace(load_cluster("a100-80gb"), intra_node_bandwidth_bytes_per_second=200e9)
    cfg = preset("llama-70b")
    # OpenRLHF's 70B row: 2 engines of TP 2, 8 prompts in flight each, 1,024 + 1,024 tokens
    plain = vllm_generate_seconds(a800, cfg, "bf16", VllmEngine(tp=2), 8, 1024, 1024)
    ray = vllm_generate_seconds(a800, cfg, "bf16", VllmEngine(tp=2, step_overhead_seconds=ray_tp_step_seconds(2)), 8,
                                1024, 1024)
    assert decode_rounds(8, 8) == 1
    assert ray - plain == pytest.approx(1 * 1024 * 0.0036)


def test_an_offloaded_zero3_partition_is_copied_up_for_every_gather():
    a100 = load_cluster("a100-80gb")
    cfg = preset("llama-7b")
    role = ModelRole("actor", cfg, "bf16", trainable=True, zero_stage=3, gradient_checkpointing=True)
    mfc = MFC("train", "train_step", "actor", ("seqs",), (), 1024, 2048, 0, micro_batches=2, minibatches=8)
    layout = Layout.contiguous(0, Strategy(dp=8))
    estimator = Estimator(a100, use_profiles=False)
    kept = estimator.estimate(mfc, role, layout)
    offloaded = estimator.estimate(mfc, dataclasses.replace(role, offload_params=True), layout)
    params = 2 * 32000 * 4096 + 32 * (4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096) + 4096  # LLaMA-2-7B's 6.74e9
    assert stage_param_elements(cfg, 1, 1, 1) == (params,)
    # 8 optimizer steps x 2 micro-batches x 3 gathers (forward, recomputed forward, backward) of 1/8 of the bf16
    # parameters over the 25 GB/s host link
    assert offloaded.seconds - kept.seconds == pytest.approx(8 * 2 * 3 * params * 2 / 8 / 25e9)
    assert offloaded.state_bytes == kept.state_bytes - int(params * 2 / 8)


def test_deepspeed_chat_rows_run_its_benchmark_scripts_settings(published):
    actor, critic = published["deepspeed-chat-7b-training"].stage.models
    assert (actor.zero_stage, actor.offload_optimizer, actor.offload_params, actor.micro_batch) == (2, True, False, 8)
    assert (critic.zero_stage, critic.offload_optimizer, critic.offload_params, critic.critic) == (3, True, True, True)
    actor13, critic13 = published["deepspeed-chat-13b-training"].stage.models
    assert (actor13.arch, actor13.gpus, actor13.micro_batch, critic13.zero_stage) == ("llama-13b", 8, 2, 3)
    bare = published["deepspeed-chat-7b-training-no-offload"].stage
    assert [(p.zero_stage, p.offload_optimizer, p.offload_params, p.micro_batch) for p in bare.models] == [
        (2, False, False, 4), (3, False, False, 4)]
    assert not bare.concurrent and bare.train_batch == 128


def test_openrlhf_rows_run_its_scripts_settings(published):
    for name, zero in (("openrlhf-7b-training", 2), ("openrlhf-ray-13b-training", 2),
                       ("openrlhf-ray-vllm-34b-training", 3), ("openrlhf-ray-vllm-70b-training", 3)):
        models = published[name].stage.models
        assert [(p.zero_stage, p.offload_optimizer, p.offload_params) for p in models] == [(zero, True, False)] * 2
    gen70 = published["openrlhf-ray-vllm-70b-generation"].stage
    assert (gen70.engines, gen70.tp, gen70.live) == (2, 2, 4 * 4 // 2)  # 4 actor ranks x 4 prompts over 2 engines
    gen7 = published["openrlhf-ray-vllm-7b-generation"].stage
    assert (gen7.engines, gen7.tp, gen7.live) == (2, 1, 16)  # 2 actor ranks x 16 prompts over 2 engines
