"""The uncertainty band ``restage plan`` prints and ``restage report`` uses, against the stored calibration errors.

The expected figures are worked out here from ``restage.accuracy``'s stored checks with numpy's
quantiles (the 10% and 90% of the measured/predicted ratios, linear between the sorted values),
not by calling the function under test.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from plan_helpers import ppo_config

from restage import accuracy
from restage.plan.cli import render, summary
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule

GIB = 2**30


def _by_hand(checks: accuracy.CheckSet) -> tuple[float, float]:
    """numpy's linear quantiles (position q (n - 1)) of the stored measured/predicted ratios: an independent computation."""
    ratios = [c.measured_seconds / c.predicted_seconds for c in checks.checks]
    assert len(ratios) >= 6
    # widened to ratio 1 (the prediction) where both quantiles lie on one side of it
    return min(1.0, float(np.quantile(ratios, 0.1))), max(1.0, float(np.quantile(ratios, 0.9)))


def test_the_bands_are_the_quantiles_of_the_stored_errors():
    gpu, cpu = accuracy.prediction_band(True), accuracy.prediction_band(False)
    assert (gpu.low_ratio, gpu.high_ratio) == pytest.approx(_by_hand(accuracy.GPU_VALIDATION), rel=1e-12)
    assert (cpu.low_ratio, cpu.high_ratio) == pytest.approx(_by_hand(accuracy.CPU_VALIDATION), rel=1e-12)
    assert (gpu.points, cpu.points) == (len(accuracy.GPU_VALIDATION.checks), len(accuracy.CPU_VALIDATION.checks))


def _checks(ratios: np.ndarray) -> accuracy.CheckSet:
    return accuracy.CheckSet("test points", "test", tuple(accuracy.Check(f"c{i}", 2.0, 2.0 * float(r))
                                                           for i, r in enumerate(ratios)))


@pytest.mark.parametrize("bias", [0.4, 0.65, 0.9, 1.0, 1.2, 2.5])  # measured / predicted about this on average
@pytest.mark.parametrize("seed", range(4))
def test_the_band_always_contains_its_own_prediction(bias, seed):
    """Over check sets whose errors are all on one side (the CPU set's are all below 1) or spread across it, and
    predictions from milliseconds to hours: the printed band holds the prediction, and each end is its quantile
    wherever that quantile is on its own side of the prediction."""
    rng = np.random.default_rng(seed)
    ratios = bias * np.exp(rng.normal(0.0, 0.15, size=int(rng.integers(5, 15))))
    band = accuracy.band_of(_checks(ratios))
    q_low, q_high = float(np.quantile(ratios, 0.1)), float(np.quantile(ratios, 0.9))
    assert band.quantile_ratios == pytest.approx((q_low, q_high), rel=1e-12)
    assert band.low_ratio == pytest.approx(min(1.0, q_low), rel=1e-12)
    assert band.high_ratio == pytest.approx(max(1.0, q_high), rel=1e-12)
    for predicted in (0.0463, 0.7, 12.5, 3600.0):
        low, high = band.seconds(predicted)
        assert low <= predicted <= high, (predicted, low, high, ratios)
    widened = q_high < 1.0 or q_low > 1.0
    assert ("widened" in band.describe()) == widened


def test_the_stored_bands_contain_their_prediction():
    for band in (accuracy.prediction_band(True), accuracy.prediction_band(False)):
        assert band.low_ratio <= 1.0 <= band.high_ratio, band.describe()


def test_the_stored_gpu_checks_are_what_bench_validation_predicts_now(bench_module):
    """Fails when the cost model changes without the stored checks being replaced (restage/accuracy.py says how).
    The untouched set's checks are its one prediction, so they are checked against its record, not predicted again."""
    validation, validation_set = bench_module("validation"), bench_module("validation_set")
    predicted = validation.predictions("held_out", validation.ScaleTerms())  # the estimator alone, as restage plan
    (record,) = validation.untouched_records()
    untouched = {r["name"]: r["estimator"]["predicted_seconds"] for r in json.loads(record.read_text())["untouched"]["rows"]}
    predicted.update(untouched)
    measured = {p.name: p.measured_seconds for which in ("held_out", "untouched") for p in validation_set.points(which)}
    assert set(untouched) == {p.name for p in validation_set.points("untouched")}
    assert set(predicted) == {c.name for c in accuracy.GPU_VALIDATION.checks}
    for check in accuracy.GPU_VALIDATION.checks:
        assert round(predicted[check.name], 2) == check.predicted_seconds, check.name
        assert measured[check.name] == pytest.approx(check.measured_seconds, rel=1e-12), check.name


def test_the_stored_cpu_checks_are_the_evaluated_plans_and_the_held_out_sets_one_predictions(bench_module):
    """The CPU bands' points: bench/estimator.py's evaluated plans and bench/cpu_unprofiled.py's fresh and third sets
    (unprofiled), and the third set predicted as profiled plans; each set's checks are its record (predicted once; its
    runs' logs stay on the machine that ran them)."""
    estimator, unprofiled = bench_module("estimator"), bench_module("cpu_unprofiled")

    def record(name: str, chosen: str) -> list[dict]:
        rows = json.loads((unprofiled.ROOT / "docs" / name).read_text())
        assert rows["set"] == chosen and [r["job"] for r in rows["jobs"]] == list(unprofiled.SETS[chosen][1])
        return rows["jobs"]

    def holds(stored: dict[str, accuracy.Check], rows: list[dict]) -> None:
        for row in rows:
            check = stored[row["job"]]
            assert check.predicted_seconds == round(row["predicted_iteration_seconds"], 4), row["job"]
            assert check.measured_seconds == round(row["measured_iteration_seconds"], 4), row["job"]

    fresh = record("cpu_check_2026-11-29_fresh.json", "2026-11-29")
    third = record("cpu_check_2026-11-29-b_heldout.json", "2026-11-29-b")
    stored = {c.name: c for c in accuracy.CPU_VALIDATION.checks}
    assert set(stored) == set(estimator.PLANS) | {r["job"] for r in fresh + third}
    holds(stored, fresh + third)
    assert accuracy.CPU_PROFILED is not None
    profiled = record("cpu_check_2026-11-29-b_heldout_profiled.json", "2026-11-29-b")
    assert all(r["sources"] and all(s.startswith("profile:") for s in r["sources"]) for r in profiled)
    stored = {c.name: c for c in accuracy.CPU_PROFILED.checks}
    assert set(stored) == {r["job"] for r in profiled}
    holds(stored, profiled)


def _printed_band(text: str) -> tuple[float, float, float]:
    found = re.search(r"iteration (\d+\.\d+) s \(likely (\d+\.\d+)-(\d+\.\d+) s\)", text)
    assert found, text
    predicted, low, high = map(float, found.groups())
    return predicted, low, high


@pytest.mark.parametrize("name", ["ppo-llama-tiny-local-cpu", "ppo-7b-h100x8"])
def test_restage_plan_prints_the_band_of_the_stored_errors(name):
    plan = {"mode": "heuristic", "heuristic": "colocated"}
    cfg = (ppo_config("llama-tiny", "llama-tiny", cluster="local-cpu", batch=8, prompt=16, gen=16, zero=0, plan=plan)
           if name == "ppo-llama-tiny-local-cpu" else ppo_config("llama-7b", "llama-7b", plan=plan))
    outcome = make_plan(cfg, with_baselines=False)
    schedule = build_schedule(cfg, outcome)
    gpus = name.endswith("h100x8")
    low_ratio, high_ratio = _by_hand(accuracy.GPU_VALIDATION if gpus else accuracy.CPU_VALIDATION)
    iteration = schedule.predicted.iteration_seconds
    printed, low, high = _printed_band(render(schedule, outcome))
    assert printed == round(iteration, 3)
    assert (low, high) == (round(iteration * low_ratio, 3), round(iteration * high_ratio, 3))
    data = summary(schedule, outcome)
    assert data["iteration_band_seconds"] == pytest.approx([iteration * low_ratio, iteration * high_ratio], rel=1e-12)
    baseline = accuracy.PROCESS_BASELINES["gpu" if gpus else "cpu"].bytes
    assert data["process_baseline_bytes"] == baseline
    assert f"+ {baseline / GIB:.2f} GiB process baseline per rank" in render(schedule, outcome)
