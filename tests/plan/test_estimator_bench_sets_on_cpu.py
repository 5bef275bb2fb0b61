"""bench/estimator.py's two sets are disjoint (issue 15, item 4) and its stability figure is what it says."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bench(bench_module):
    return bench_module("estimator")


def test_the_evaluated_plans_share_no_layout_model_or_job_size_with_the_calibration(bench):
    calibration_layouts = [layouts for _, layouts in bench.CALIBRATION.values()]
    assert len(bench.PLANS) >= 10
    assert all(plan not in calibration_layouts for plan in bench.PLANS.values())
    assert len({tuple(sorted(p.items())) for p in bench.PLANS.values()}) == len(bench.PLANS)  # no plan twice
    sizes = {(s["run.batch_size"], s["generation.max_new_tokens"]) for s, _ in bench.CALIBRATION.values()}
    assert (bench.EVAL_SIZE["run.batch_size"], bench.EVAL_SIZE["generation.max_new_tokens"]) not in sizes
    assert all(s.get("models.actor.path") is None for s, _ in bench.CALIBRATION.values())
    assert bench.EVAL_SIZE["models.actor.path"] == bench.EVAL_MODEL_PATH != "results/assets/tiny-llama"
    assert bench.EVAL_MODEL["hidden_size"] != 64 and bench.EVAL_MODEL["num_layers"] != 2  # the calibration's model


def test_stability_is_the_relative_spread_between_fits(bench):
    fits = [{"a_seconds": 1.0, "b_seconds": 0.0, "c_seconds": 2.0}, {"a_seconds": 0.8, "b_seconds": 0.0, "c_seconds": 1.0}]
    result = bench.stability(fits)
    assert result["relative_spread"] == pytest.approx({"a_seconds": 0.2, "b_seconds": 0.0, "c_seconds": 0.5})
    assert result["within_20_percent"] is False
    assert bench.stability(fits[:1] * 2)["within_20_percent"] is True
