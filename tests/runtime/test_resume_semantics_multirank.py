"""--resume of a trial with nothing saved is refused before any rank starts; a trial whose run failed before its
first step can be started again without --overwrite (no loop between "pass --resume" and "run without it")."""

import time

import pytest
from runs import restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=2"]


def test_a_trial_that_failed_before_its_first_step_starts_again(tmp_path):
    trial = tmp_path / "ppo-tiny" / "t"
    failed = restage_run(tmp_path, *JOB, "trial=t", "reward_fn=faulty_reward:broken", timeout=300)
    assert failed.returncode != 0 and "reward function broke before the first step" in failed.stderr
    assert read_log(trial).last_complete_step == 0  # steps count from 1: none complete
    started = time.monotonic()
    resumed = restage_run(tmp_path, "jobs/ppo_tiny.yaml", "-n", "2", "trial=t", "--resume", timeout=120)
    assert time.monotonic() - started < 30 and resumed.returncode == 2
    assert resumed.stderr.strip().splitlines() == [
        f"restage: error: {trial} has no checkpoint to resume from (no step of it was saved); run it without "
        "--resume to start it afresh"]
    again = restage_run(tmp_path, *JOB, "trial=t", timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"restage: {trial}: the earlier run ended before its first step; starting it afresh" in again.stdout
    assert read_log(trial).last_complete_step == 2
