"""bench/gpu_gemm.py (issue 15, GPU costs by per-rank shape): its shapes are the decoder's and the estimator's, its
prediction column is plan/gemm.py's, its FLOP/s are FLOPs over the recorded times. Run on CPU with tiny shapes."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from restage.cluster import load_cluster
from restage.models.flops import block_shape
from restage.models.presets import preset
from restage.plan.compute import RooflineCompute, block_gemms
from restage.plan.gemm import MAMF_SHAPES, gemm_efficiency, mamf_efficiency


@pytest.fixture(scope="module")
def bench(bench_module):
    return bench_module("gpu_gemm")


@pytest.fixture(scope="module")
def result(bench):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--device", "cpu", "--cluster", "h200-141gb", "--shapes", "tiny", "--repeats", "2",
                           "--warmup", "1", "--rotate-bytes", "65536", "--json"]) == 0
    return json.loads(out.getvalue())


def test_the_estimator_costs_a_block_as_four_fused_gemms():
    s = block_shape(preset("llama-7b"), 1)
    assert block_gemms(s) == (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008))
    s8 = block_shape(preset("llama-70b"), 8)  # 64 heads of 128, 8 KV heads, MLP 28672, over 8 ranks
    assert block_gemms(s8) == (("qkv", 1024 + 2 * 128, 8192), ("o", 8192, 1024), ("gate_up", 7168, 8192),
                               ("down", 8192, 3584))


def test_the_shapes_are_the_decoders_and_the_estimators_per_rank_gemms(bench):
    # llama-tiny: hidden 64, MLP 172, 4 heads of 16, 2 KV heads, vocabulary 512; tp 1 and 2 (2 KV heads: not 4, 8).
    assert bench.tp_degrees(preset("llama-tiny")) == [1, 2]
    shapes = bench.shapes_of(bench.tiny_archs(), (1, 8))
    tp1 = {(n, k) for (m, n, k), where in shapes.items() if m == 1 and any("/tp1/" in w for w in where)}
    assert tp1 == {(64, 64), (32, 64), (172, 64), (64, 172), (128, 64), (344, 64), (512, 64)}
    tp2 = {(n, k) for (m, n, k), where in shapes.items() if m == 8 and any("/tp2/" in w for w in where)}
    assert tp2 == {(32, 64), (16, 64), (64, 32), (86, 64), (64, 86), (64, 64), (172, 64), (256, 64)}
    assert sorted(shapes[(1, 32, 64)]) == ["llama-tiny/tp1/k", "llama-tiny/tp1/v", "llama-tiny/tp2/q"]
    assert [g for g, _, _ in bench.runtime_gemms(block_shape(preset("llama-tiny"), 1))] == [
        "q", "k", "v", "o", "gate", "up", "down"]


def test_every_shape_is_measured_and_its_prediction_is_gemm_py(bench, result):
    h200 = load_cluster("h200-141gb")
    assert (result["cluster"], result["dtype"], result["truncated"]) == ("h200-141gb", "bf16", False)
    expected = set(bench.shapes_of(bench.tiny_archs(), (1, 8, 64)))
    assert {(r["rows"], r["cols"], r["depth"]) for r in result["rows"]} == expected
    for r in result["rows"]:
        m, n, k = r["rows"], r["cols"], r["depth"]
        assert r["predicted_efficiency"] == gemm_efficiency(h200, m, n, k)
        assert r["predicted_tflops"] == pytest.approx(989.0 * gemm_efficiency(h200, m, n, k))
        assert len(r["sample_seconds"]) == 2 and r["seconds"] == statistics.median(r["sample_seconds"])
        assert r["copies"] == bench.operand_copies(m, n, k, 2, 65536) and r["inner"] % r["copies"] == 0
        assert r["flops"] == 2 * m * n * k
        assert r["achieved_tflops"] == pytest.approx(r["flops"] / r["seconds"] / 1e12, rel=1e-12)
        assert r["measured_efficiency"] == pytest.approx(r["flops"] / r["seconds"] / 989e12, rel=1e-12)
        assert r["efficiency_error_percent"] == pytest.approx(
            100 * (r["predicted_efficiency"] - r["measured_efficiency"]) / r["measured_efficiency"])
        roofline = max(r["flops"] / (989e12 * r["predicted_efficiency"]), 2 * (m * k + k * n + m * n) / (4.8e12 * 0.75))
        assert r["predicted_seconds"] == pytest.approx(roofline)
    errors = [abs(r["efficiency_error_percent"]) for r in result["rows"]]
    assert result["summary"]["median_abs_efficiency_error_percent"] == pytest.approx(statistics.median(errors))


def test_the_operands_rotate_through_copies_larger_than_the_l2_cache(bench):
    assert bench.ROTATE_BYTES > 50e6  # the L2 cache of an H100 / H200
    assert bench.operand_copies(1, 1024, 1024, 2, 128 * 2**20) == 64  # 2 x (1024 + 1024 x 1024) bytes a copy
    assert bench.operand_copies(16384, 8192, 8192, 2, 128 * 2**20) == 1  # 384 MiB of operands: one copy
    assert bench.operand_copies(1, 16, 64, 2, 128 * 2**20) == bench.MAX_COPIES
    assert bench.operand_copies(1, 1024, 1024, 2, 0) == 1


def test_a_blocks_gemms_are_the_runtimes_seven_measured_against_block_matmuls(bench, result):
    h200 = load_cluster("h200-141gb")
    roofline = RooflineCompute(h200, preset("llama-tiny"), "bf16")
    measured = {(r["rows"], r["cols"], r["depth"]): r["seconds"] for r in result["rows"]}
    assert len(result["blocks"]) == 2 * 3  # tp 1, 2 x M 1, 8, 64
    for b in result["blocks"]:
        s = block_shape(preset("llama-tiny"), b["tp"])
        runtime = [(b["rows"], s.q_out, 64), (b["rows"], s.kv_out, 64), (b["rows"], s.kv_out, 64), (b["rows"], 64, s.q_out),
                   (b["rows"], s.inter, 64), (b["rows"], s.inter, 64), (b["rows"], 64, s.inter)]
        assert b["runtime_gemms_seconds"] == pytest.approx(sum(measured[shape] for shape in runtime))
        assert b["predicted_seconds"] == roofline.block_matmuls(b["rows"], b["tp"])


def test_the_text_table_is_the_saved_json(bench, result, tmp_path):
    saved = tmp_path / "gemm.json"
    saved.write_text(json.dumps(result))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main(["--from", str(saved)]) == 0
    lines = out.getvalue().splitlines()
    assert len([line for line in lines if "llama-tiny/tp" in line]) == len(result["rows"])
    median = result["summary"]["median_abs_efficiency_error_percent"]
    assert f"median |efficiency error| {median:.1f}%" in lines[-2]


def test_the_h200_file_has_the_datasheet_figures_and_the_h100s_efficiencies():
    h200, h100 = load_cluster("h200-141gb"), load_cluster("h100-80gb")
    assert h200.peak_bf16_flops_per_second == 989e12 and h200.memory_bandwidth_bytes_per_second == 4.8e12
    assert h200.memory_bytes == 141 * 2**30 and h200.intra_node_bandwidth_bytes_per_second == 450e9
    for field in ("compute_efficiency", "attention_efficiency", "memory_efficiency", "network_efficiency",
                  "block_overhead_seconds", "peak_fp32_flops_per_second", "inter_node_bandwidth_bytes_per_second"):
        assert getattr(h200, field) == getattr(h100, field), field
    assert mamf_efficiency(h200) == mamf_efficiency(h100) == pytest.approx(792.1 / 989)
    assert gemm_efficiency(h200, *MAMF_SHAPES["H200"]) == pytest.approx(h200.compute_efficiency)
    assert gemm_efficiency(h200, 512, 1536, 1536) == gemm_efficiency(h100, 512, 1536, 1536)
