"""bench/runtime_vs_estimate.py (scripts/gpu_check.sh's `costs` part): a run's measured seconds and memory per MFC
beside the estimator's prediction, checked on a synthetic log whose durations and predictions are known exactly."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from restage.accuracy import PROCESS_BASELINES
from restage.report.synthetic import BASE_SECONDS, PEAK_MEMORY_BYTES, PREDICTED_FACTOR, write_synthetic_log


@pytest.fixture(scope="module")
def bench(bench_module):
    return bench_module("runtime_vs_estimate")


def test_per_mfc_measured_and_predicted_seconds_and_memory(bench, tmp_path):
    log = write_synthetic_log(tmp_path / "run" / "log.h5", steps=6, world_size=4, noise=0.0)
    result = bench.compare(log.parent)
    assert result["steps"] == 6 and result["world_size"] == 4
    assert [m["name"] for m in result["mfcs"]] == list(PREDICTED_FACTOR)  # run order: reward_inf before critic_inf
    gpu_baseline = PROCESS_BASELINES["gpu"].bytes  # the synthetic cluster is an A100
    for m in result["mfcs"]:
        base, factor = BASE_SECONDS[m["name"]], PREDICTED_FACTOR[m["name"]]
        assert m["step_seconds"] == pytest.approx([base] * 6)
        assert m["measured_seconds"] == pytest.approx(base)
        assert m["predicted_seconds"] == pytest.approx(base * factor)
        assert m["measured_over_predicted"] == pytest.approx(1 / factor)
        assert m["error_percent"] == pytest.approx(100 * (factor - 1), abs=1e-3)  # times stored at float precision
        assert m["predicted_peak_memory_bytes"] == int(PEAK_MEMORY_BYTES[m["name"]] * 0.9) + gpu_baseline
    assert result["median_abs_mfc_error_percent"] == pytest.approx(
        statistics.median(abs(100 * (f - 1)) for f in PREDICTED_FACTOR.values()), abs=1e-3)


def test_json_and_text_carry_the_same_figures(bench, tmp_path):
    log = write_synthetic_log(tmp_path / "run" / "log.h5", steps=3, world_size=2, noise=0.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main([str(log.parent), "--json"]) == 0
    saved = json.loads(out.getvalue())
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main([str(log.parent)]) == 0
    line = next(x for x in out.getvalue().splitlines() if x.startswith("actor_gen "))
    gen = next(m for m in saved["mfcs"] if m["name"] == "actor_gen")
    assert line.split()[1:4] == [f"{gen['measured_seconds']:.4f}", f"{gen['predicted_seconds']:.4f}", "-10.0%"]
