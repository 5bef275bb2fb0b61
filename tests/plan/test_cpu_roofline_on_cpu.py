"""The CPU roofline's threads, cache, GEMM-rows and weight-read terms (cluster fields, RooflineCompute), the
profiled/unprofiled band choice, bench/cpu_rates.py's reading of its measurements and bench/cpu_roofline_fit.py's
fit: each against hand-worked numbers."""

import dataclasses
import sys
from pathlib import Path

import pytest

from restage import accuracy
from restage.cluster import cluster_from_config, load_cluster
from restage.config.load import load_config
from restage.errors import ConfigError
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.plan.compute import DTYPE_BYTES, ProfiledCompute, RooflineCompute, elementwise_elements_per_token, thread_scale
from restage.plan.gemm import CPU_REFERENCE_ROWS, gemm_efficiency
from restage.plan.profile import Profile, ProfileEntry

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import cpu_rates  # noqa: E402  (bench/ is not a package)
import cpu_roofline_fit  # noqa: E402

MODEL = ModelConfig(family="llama", model_type="llama", vocab_size=16, hidden_size=256, intermediate_size=704,
                    num_layers=4, num_heads=8, num_kv_heads=4, max_positions=64)


def _cpu(**fields):
    """local-cpu with the CPU fields set to round numbers (no overheads, no GEMM-rows or weight-read term), two ranks on
    a node."""
    base = dict(cores_per_node=4, threads_per_rank=0, thread_efficiency=0.5, cache_bytes=1 << 20,
                cache_bandwidth_bytes_per_second=50e9, memory_bandwidth_bytes_per_second=10e9, memory_efficiency=1.0,
                block_overhead_seconds=0.0, gemm_half_rows=0.0, weight_read_bytes_per_second=0.0)
    return dataclasses.replace(load_cluster("local-cpu"), **(base | fields))


def test_a_rank_takes_its_share_of_the_cores_unless_told():
    c = _cpu()
    assert c.devices_per_node == 2 and c.rank_threads == 2  # 4 cores over 2 ranks
    assert c.thread_speedup == pytest.approx(1 + 1 * 0.5)
    assert _cpu(threads_per_rank=3).thread_speedup == pytest.approx(1 + 2 * 0.5)
    assert _cpu(cores_per_node=0).rank_threads == 1  # unknown cores: one thread
    assert c.with_size(devices_per_node=1).rank_threads == 4
    gpu = dataclasses.replace(load_cluster("h100-80gb"), threads_per_rank=8)
    assert gpu.thread_speedup == 1.0  # a GPU rank's threads do not compute


def test_an_op_streams_from_the_cache_while_its_largest_tensor_fits():
    c = _cpu()
    assert c.stream_bandwidth(1 << 20) == pytest.approx(50e9 * 1.5)
    assert c.stream_bandwidth((1 << 20) + 1) == pytest.approx(10e9 * 1.5)
    assert _cpu(cache_bytes=0).stream_bandwidth(1) == pytest.approx(10e9 * 1.5)  # no cache measured: memory's rate


def test_the_roofline_costs_cpu_ops_at_the_cache_or_memory_rate_and_the_thread_speedup():
    c = _cpu()
    r = RooflineCompute(c, MODEL, "fp32")
    s, e = block_shape(MODEL, 1), DTYPE_BYTES["fp32"]
    # Elementwise traffic and the optimizer step, by hand: bytes over the rate their largest tensor allows.
    tokens = 64  # largest elementwise tensor 64 x 704 x 4 B = 180 KB: in the cache
    assert r._stream(tokens * elementwise_elements_per_token(s) * e, tokens * s.inter) == pytest.approx(
        tokens * elementwise_elements_per_token(s) * e / 75e9)
    params = 1e6  # the fp32 master copy, 4 MB, does not fit 1 MiB: memory's rate
    assert r.optimizer_step(params) == pytest.approx(params * 28 / 15e9)
    assert r.optimizer_step(1e4) == pytest.approx(1e4 * 28 / 75e9)
    # A GEMM-bound forward computes at one thread's peak x efficiency x the speedup.
    big = RooflineCompute(_cpu(cache_bytes=0), MODEL, "fp32")
    one = RooflineCompute(_cpu(cache_bytes=0, threads_per_rank=1), MODEL, "fp32")
    flops = sum(2 * 4096 * cols * depth for _, cols, depth in
                (("qkv", s.q_out + 2 * s.kv_out, s.hidden), ("o", s.hidden, s.q_out), ("gu", 2 * s.inter, s.hidden),
                 ("down", s.hidden, s.inter)))
    assert one.block_matmuls(4096, 1) == pytest.approx(flops / (c.peak_fp32_flops_per_second * c.compute_efficiency))
    assert big.block_matmuls(4096, 1) == pytest.approx(one.block_matmuls(4096, 1) / 1.5)


def test_gpu_clusters_are_costed_exactly_as_without_the_cpu_fields():
    h100 = load_cluster("h100-80gb")
    with_fields = dataclasses.replace(h100, cores_per_node=64, threads_per_rank=8, thread_efficiency=0.5,
                                      cache_bytes=50 << 20, cache_bandwidth_bytes_per_second=1e13, gemm_half_rows=8,
                                      weight_read_bytes_per_second=1e9)
    a, b = RooflineCompute(h100, MODEL, "bf16"), RooflineCompute(with_fields, MODEL, "bf16")
    for f in ("block_forward", "block_backward", "block_prefill", "decode_block"):
        assert getattr(a, f)(8, 32, 1) == getattr(b, f)(8, 32, 1)
    assert a.optimizer_step(1e6) == b.optimizer_step(1e6)


def test_a_cpu_gemm_of_few_rows_runs_below_its_square_rate():
    c = _cpu(gemm_half_rows=8)
    e = c.compute_efficiency
    assert gemm_efficiency(c, CPU_REFERENCE_ROWS, 64, 64) == pytest.approx(e)  # the measured shapes' rate
    assert gemm_efficiency(c, 8, 512, 512) == pytest.approx(e * (8 / 16) / (1024 / 1032))
    assert gemm_efficiency(c, 1e6, 512, 512) == pytest.approx(e)  # never above it
    assert gemm_efficiency(_cpu(), 1, 512, 512) == pytest.approx(e)  # the term off: flat


def test_a_cpu_gemm_reads_its_weights_before_computing():
    rate = 8e9
    plain = RooflineCompute(_cpu(cache_bytes=0), MODEL, "fp32")
    reads = RooflineCompute(_cpu(cache_bytes=0, weight_read_bytes_per_second=rate), MODEL, "fp32")
    s = block_shape(MODEL, 1)
    for rows in (1, 32, 4096):
        flops = sum(2 * rows * cols * depth for _, cols, depth in
                    (("qkv", s.q_out + 2 * s.kv_out, s.hidden), ("o", s.hidden, s.q_out), ("gu", 2 * s.inter, s.hidden),
                     ("down", s.hidden, s.inter)))
        compute = flops / (1.5 * 118.4e9 * reads.cluster.compute_efficiency)  # local-cpu's peak x the speedup
        # the FLOP time plus the weights at the read rate (times the rank's 1.5x thread speedup), added
        assert reads.block_matmuls(rows, 1) == pytest.approx(compute + s.weight_params * 4 / (rate * 1.5))
    # without the term a one-row GEMM is the larger of its FLOPs and its bytes at memory's rate
    assert plain.block_matmuls(1, 1) == pytest.approx((s.weight_params + s.hidden + s.inter) * 4 / 15e9)


def test_the_roofline_fit_finds_the_constants_it_was_built_from(monkeypatch):
    """bench/cpu_roofline_fit.py on synthetic profiles made by the roofline itself at known constants (the measured
    GEMM-rows and weight-read terms set): the grid point they sit on scores 0 and is the one found; halves agree."""
    truth = {"block_overhead_seconds": 5e-4, "compute_efficiency": 0.70}
    base = _cpu(cache_bytes=0, threads_per_rank=1, gemm_half_rows=6.25, weight_read_bytes_per_second=17.7e9)
    made = RooflineCompute(dataclasses.replace(base, **truth), MODEL, "fp32")
    entries = [{"op": op, "tp": 1, "batch": b, "seq": q, "seconds": getattr(made, method)(b, q, 1)}
               for op, method in cpu_roofline_fit.OPS.items() for b in (1, 4, 32) for q in (8, 64)]
    profiles = [("made", MODEL, entries)]
    assert cpu_roofline_fit.mean_abs(cpu_roofline_fit.log_errors(dataclasses.replace(base, **truth), profiles)) \
        == pytest.approx(0, abs=1e-12)
    small = {k: tuple(sorted({*v[::3], truth[k]})) for k, v in cpu_roofline_fit.GRID.items()}
    monkeypatch.setattr(cpu_roofline_fit, "GRID", small)
    assert cpu_roofline_fit.fit(base, profiles) == pytest.approx(truth)
    assert cpu_roofline_fit.stability(truth, truth) == {k: 0.0 for k in truth}
    assert cpu_roofline_fit.stability({"a": 1.0}, {"a": 3.0}) == {"a": pytest.approx(1.0)}


def test_cluster_fields_are_checked():
    with pytest.raises(ConfigError, match="thread_efficiency must be in"):
        _cpu(thread_efficiency=1.5)
    with pytest.raises(ConfigError, match="cache_bytes must not be negative"):
        _cpu(cache_bytes=-1)


def test_the_run_sets_a_rank_s_threads_as_the_runtime_will(monkeypatch):
    job = ROOT / "jobs" / "ppo_tiny.yaml"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cluster_from_config(load_config(job)).rank_threads == 1
    assert cluster_from_config(load_config(job, ["run.threads_per_rank=2"])).rank_threads == 2  # the config first
    monkeypatch.delenv("OMP_NUM_THREADS")
    spec = load_cluster("local-cpu")
    assert cluster_from_config(load_config(job)).rank_threads == spec.rank_threads  # the file's cores over ranks


def test_profiled_plans_take_their_own_band_where_one_is_recorded(monkeypatch):
    assert accuracy.profiled(["profile:local-cpu--tiny-llama--fp32", "profile:x+roofline"])  # a critic's head
    assert not accuracy.profiled(["profile:local-cpu--tiny-llama--fp32", "roofline"])
    assert not accuracy.profiled([])
    unprofiled = accuracy.prediction_band(False)
    assert accuracy.prediction_band(True, profiled=True) == accuracy.prediction_band(True)  # none on GPUs yet
    assert accuracy.CPU_PROFILED is not None and accuracy.prediction_band(False, profiled=True) == accuracy.band_of(
        accuracy.CPU_PROFILED)
    checks = accuracy.CheckSet("profiled", "by hand", tuple(accuracy.Check(str(i), 1.0, m) for i, m in
                                                             enumerate((0.8, 0.9, 1.0, 1.1, 1.2))))
    monkeypatch.setattr(accuracy, "CPU_PROFILED", checks)
    band = accuracy.prediction_band(False, profiled=True)
    assert (band.low_ratio, band.high_ratio) == pytest.approx((0.84, 1.16))  # 10% and 90% quantiles of 5 ratios
    assert accuracy.prediction_band(False) == unprofiled


def test_cpu_rates_reads_the_cache_edge_from_the_stream_curve():
    rates = {1 << 14: 30e9, 1 << 15: 60e9, 1 << 16: 90e9, 1 << 17: 80e9, 1 << 18: 70e9, 1 << 19: 40e9, 1 << 20: 30e9}
    # Fastest 90 at 64 KiB; 80 and 70 stay above half of it, 40 does not; 60 (below the fastest size) counts too.
    assert cpu_rates.cache_edge(rates) == (1 << 18, pytest.approx(75e9))


def test_cpu_rates_reads_the_rows_half_point_from_the_linear_rates():
    rows = cpu_rates.ROWS
    rates = {r: 100e9 * (r / (r + 5.0)) for r in rows}  # made with h = 5 (1 and 2 rows left out of the fit)
    assert cpu_rates.half_rows(rates) == 5.0
    rates[1] = rates[2] = 1.0  # the weight-bound rows do not move it
    assert cpu_rates.half_rows(rates) == 5.0


def test_a_profile_is_scaled_from_its_threads_to_the_rank_s():
    entries = [ProfileEntry("block_forward", 1, b, q, 1e-3 * b * q) for b in (1, 8) for q in (8, 64)]
    entries.append(ProfileEntry("optimizer_step_per_param", 1, 1, 1, 2e-9))
    one_thread = Profile("p", "local-cpu", "fp32", MODEL, entries, {"threads": 1})
    two_ranks, one_rank = _cpu(cores_per_node=2), _cpu(cores_per_node=2).with_size(devices_per_node=1)
    assert (two_ranks.rank_threads, one_rank.rank_threads) == (1, 2)
    assert thread_scale(one_thread, two_ranks) == 1.0
    assert thread_scale(one_thread, one_rank) == pytest.approx(1 / 1.5)  # thread_efficiency 0.5
    two_threads = dataclasses.replace(one_thread, meta={"threads": 2})
    assert thread_scale(two_threads, one_rank) == pytest.approx(1.0)
    assert thread_scale(two_threads, two_ranks) == pytest.approx(1.5)
    assert thread_scale(dataclasses.replace(one_thread, meta={}), one_rank) == pytest.approx(1 / 1.5)  # unrecorded: 1
    h100 = load_cluster("h100-80gb")
    assert thread_scale(two_threads, dataclasses.replace(h100, threads_per_rank=8)) == 1.0  # GPU ranks: as measured
    priced = ProfiledCompute(one_thread, RooflineCompute(one_rank, MODEL, "fp32"))
    assert priced.block_forward(8, 64, 1) == pytest.approx(1e-3 * 8 * 64 / 1.5)
    assert priced.optimizer_step(1e6) == pytest.approx(2e-9 * 1e6 / 1.5)
