"""GRPO at ``kl_coef`` 0 under `restage run`: no reference pass, and every logged number as with one.

The run with the reference keeps it through a reference EMA (``ref_ema_eta`` > 0 needs the model; it
moves only the reference, never the actor), so its ``ref_inf`` runs each step while the KL term is
weighted by 0: what GRPO at ``kl_coef`` 0 did before it dropped the reference. Same seed, same
single rank: the sampled answers, rewards and losses must be equal to the bit.
"""

import numpy as np
import pytest
from e2e_jobs import restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.e2e]

STEPS = 3


def test_grpo_at_kl_0_runs_no_reference_and_logs_the_same_numbers(tmp_path):
    without = read_log(restage_run(tmp_path, "grpo_tiny", 1, "noref", f"run.steps={STEPS}", "algo.kl_coef=0").trial_dir)
    with_ref = read_log(restage_run(tmp_path, "grpo_tiny", 1, "ref", f"run.steps={STEPS}", "algo.kl_coef=0",
                                    "algo.ref_ema_eta=0.5").trial_dir)
    assert len(without.steps) == STEPS and list(without.schedule["models"]) == ["actor"]
    assert sorted(set(without.mfcs["name"])) == ["actor_gen", "actor_train"]
    assert sorted(set(with_ref.mfcs["name"])) == ["actor_gen", "actor_train", "ref_inf"]
    assert list(with_ref.schedule["models"]) == ["actor", "ref"]
    series, series_ref = without.stat_series(), with_ref.stat_series()
    assert set(series) == set(series_ref) and "actor_train/kl" not in series
    rewards = series["actor_train/reward"][1]
    assert len(rewards) == STEPS and np.array_equal(rewards, series_ref["actor_train/reward"][1])
    assert 0 < rewards.min() < rewards.max() < 1  # the sort task's partial credit, not a constant
    for name, (_, values) in series.items():
        assert np.array_equal(values, series_ref[name][1]), name
