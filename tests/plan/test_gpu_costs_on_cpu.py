"""The GPU cost model's pieces against the published figures they cite (docs/plan.md, "GPU cost constants")."""

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from restage.cluster import load_cluster
from restage.models.flops import block_shape
from restage.models.presets import preset
from restage.plan.compute import RooflineCompute, elementwise_elements_per_token
from restage.plan.gemm import MAMF_SHAPES, gemm_efficiency, mamf_efficiency
from restage.plan.generation_cost import VllmEngine, kv_bytes_per_token, live_sequences, vllm_generate_seconds
from restage.plan.nccl import collective_bus_bandwidth

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def a100():
    return load_cluster("a100-80gb")


@pytest.fixture
def h100():
    return load_cluster("h100-80gb")


def test_gemm_efficiency_is_the_cluster_figure_at_the_measured_shape_and_falls_with_size(a100, h100):
    for cluster, family in ((a100, "A100"), (h100, "H100")):
        assert gemm_efficiency(cluster, *MAMF_SHAPES[family]) == pytest.approx(cluster.compute_efficiency)
        sizes = [gemm_efficiency(cluster, d, 4096, 4096) for d in (1, 16, 128, 1024, 8192, 65536)]
        assert sizes == sorted(sizes) and sizes[0] < 0.1 * sizes[-1]
        assert gemm_efficiency(cluster, 1e9, 1e9, 1e9) == pytest.approx(cluster.compute_efficiency)
    # 70B's MLP down-projection per rank: TP 8 makes the depth 3,584 instead of 28,672, and slower per FLOP
    assert gemm_efficiency(h100, 4096, 8192, 28672 / 8) < gemm_efficiency(h100, 4096, 8192, 28672)


def test_compute_efficiency_is_mamf_times_one_fitted_sustained_factor(a100, h100):
    assert mamf_efficiency(a100) == pytest.approx(267.9 / 312)
    assert mamf_efficiency(h100) == pytest.approx(792.1 / 989)
    assert a100.compute_efficiency == pytest.approx(mamf_efficiency(a100) * 0.535, abs=6e-4)
    assert h100.compute_efficiency == pytest.approx(mamf_efficiency(h100) * 0.535, abs=6e-4)


def test_nccl_ring_bus_bandwidth_of_a_large_all_reduce_is_the_cited_h100_figure(h100):
    busbw = collective_bus_bandwidth(h100, range(8), 8 * 2**30)
    assert busbw == pytest.approx(370e9, rel=0.01)  # NVIDIA/nccl-tests#212: about 370 GB/s with NCCL_ALGO=RING
    assert collective_bus_bandwidth(h100, range(8), 64 * 2**10) < 0.1 * busbw  # small messages pay latency
    two_nodes = load_cluster("h100-80gb", nodes=2)
    across = collective_bus_bandwidth(two_nodes, (0, 8), 8 * 2**30)
    assert across == pytest.approx(50e9 * 0.822, rel=0.01)  # one 400 Gb/s NIC per GPU


def test_eager_decoding_is_launch_bound_at_the_gpt_fast_eager_rate(a100):
    """gpt-fast's eager LLaMA-7B on A100 decodes 25.5 tokens/s at batch 1: the 32 blocks take about 1 / 25.5 s."""
    eager = RooflineCompute(a100, preset("llama-7b"), "bf16")
    step = 32 * eager.decode_block(1, 256, 1)
    assert step == pytest.approx(1 / 25.5, rel=0.05)
    # a long attention still adds its time on top of the other kernels' launches
    assert eager.decode_block(64, 4096, 1) > 1.5 * eager.decode_block(64, 256, 1)


def test_cuda_graph_decoding_is_bound_by_weight_reads_at_the_gpt_fast_compiled_rate(a100):
    """gpt-fast's compiled (CUDA graphs) LLaMA-7B decodes 107.0 tokens/s at batch 1 on A100: weights over HBM."""
    graphs = RooflineCompute(a100, preset("llama-7b"), "bf16", launch_overhead_seconds=0.0)
    blocks = 32 * graphs.decode_block(1, 256, 1)
    head = graphs.head_forward(1, 1)
    assert blocks + head == pytest.approx(1 / 107.0, rel=0.05)


def test_elementwise_traffic_counted_from_the_decoder():
    s = block_shape(preset("llama-7b"), 1)
    assert elementwise_elements_per_token(s) == 42 * 4096 + 10 * (4096 + 4096) + 5 * 11008
    s8 = block_shape(preset("llama-7b"), 8)  # norms and residuals stay whole under TP, the rest is split
    assert elementwise_elements_per_token(s8) == 42 * 4096 + 10 * (512 + 512) + 5 * 1376
    # with sequence parallelism (Megatron's, torchtitan's) the norms and residuals touch 1/tp of the tokens
    assert elementwise_elements_per_token(s8, 8) == 42 * 4096 / 8 + 10 * (512 + 512) + 5 * 1376


def test_sequence_parallel_only_moves_tensor_parallel_blocks(a100):
    cfg = preset("llama-7b")
    plain = RooflineCompute(a100, cfg, "bf16", launch_overhead_seconds=0.0)  # device time only: no launch floor
    sp = RooflineCompute(a100, cfg, "bf16", launch_overhead_seconds=0.0, sequence_parallel=True)
    assert sp.block_forward(4, 2048, 1) == plain.block_forward(4, 2048, 1)  # tp 1: nothing to shard
    assert sp.block_backward(4, 2048, 1) == plain.block_backward(4, 2048, 1)
    s8, tokens = block_shape(cfg, 8), 4 * 2048
    saved = tokens * (elementwise_elements_per_token(s8) - elementwise_elements_per_token(s8, 8)) * 2  # bf16 bytes
    assert saved == tokens * 42 * 4096 * 7 / 8 * 2
    assert plain.block_forward(4, 2048, 8) - sp.block_forward(4, 2048, 8) == pytest.approx(
        saved / a100.stream_bandwidth(math.inf), rel=1e-9)


def test_vllm_keeps_as_many_sequences_in_flight_as_its_kv_cache_holds(a100):
    cfg = preset("llama-7b")
    assert kv_bytes_per_token(cfg, 1, "bf16") == 2 * 32 * 4096 * 2
    weights = 6.7e9
    free = 80 * 2**30 * 0.9 - weights * 2
    assert live_sequences(a100, cfg, "bf16", VllmEngine(), 10_000, 1536, weights) == pytest.approx(
        free / (2 * 32 * 4096 * 2 * 1536))
    assert live_sequences(a100, cfg, "bf16", VllmEngine(max_live_sequences=16), 10_000, 1536, weights) == 16
    # submitting 16 at a time makes 512 prompts take many rounds: slower than letting the KV cache fill
    few = vllm_generate_seconds(a100, cfg, "bf16", VllmEngine(max_live_sequences=16), 512, 1024, 1024)
    full = vllm_generate_seconds(a100, cfg, "bf16", VllmEngine(), 512, 1024, 1024)
    assert few > 1.4 * full  # KV reads grow with the batch, so batching wins less than the weights alone would say


def test_vllm_generation_is_faster_than_the_eager_runtime_for_small_batches(a100):
    cfg = preset("llama-7b")
    eager = RooflineCompute(a100, cfg, "bf16")
    graphs = RooflineCompute(a100, cfg, "bf16", launch_overhead_seconds=0.0)
    assert eager.decode_block(8, 512, 1) > 3 * graphs.decode_block(8, 512, 1)
    big = dataclasses.replace(a100, block_overhead_seconds=0.0)
    assert RooflineCompute(big, cfg, "bf16").decode_block(8, 512, 1) == pytest.approx(graphs.decode_block(8, 512, 1))


def test_calibration_against_published_measurements_meets_the_median_target_and_its_fit_is_in_the_files():
    sys.path.insert(0, str(BENCH))
    try:
        import calibration
    finally:
        sys.path.remove(str(BENCH))
    result = calibration.evaluate()
    assert len(result["rows"]) >= 10
    assert result["all"]["median_abs_error"] <= 0.30
    assert result["held_out"]["median_abs_error"] <= 0.30 and result["held_out"]["points"] >= 7
    assert calibration.fit_sustained_factor() == pytest.approx(0.535)
