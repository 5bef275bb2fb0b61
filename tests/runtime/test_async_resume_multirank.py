"""An async run whose generation rank is SIGKILLed resumes from its checkpoint (rollout buffer included) and ends
exactly where an uninterrupted run does: the same final step, the same weights and the same logged statistics.
With partial rollouts the buffer also holds the batch begun behind the last one finished (its answers so far)."""

import os
import signal
import time

import numpy as np
import pytest
import torch
from runs import hf_weights, last_checkpoint, rank_process, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

STEPS = 10
ASYNC = ["jobs/grpo_tiny.yaml", "-n", "2", f"run.steps={STEPS}", "plan.execution=async", "plan.mode=manual",
         "plan.layouts.actor_gen=ranks:1-1 dp1", "plan.layouts.ref_inf=ranks:0-0 dp1",
         "plan.layouts.actor_prox=ranks:0-0 dp1", "plan.layouts.actor_train=ranks:0-0 dp1"]


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


PARTIAL = [*ASYNC, "plan.staleness=2", "plan.partial_rollouts=true"]


# whole (about 45 s) in make test-scale only: make test's time bound; partial covers its buffer and more
@pytest.mark.parametrize("job", [pytest.param(ASYNC, marks=pytest.mark.scale), PARTIAL], ids=["whole", "partial"])
def test_sigkill_then_resume_reaches_the_straight_runs_final_step_and_weights(tmp_path, job):
    _ok(restage_run(tmp_path, *job, "trial=straight"))
    trial = tmp_path / "grpo-tiny" / "killed"
    run = restage_run(tmp_path, *job, "run.save_every=2", "trial=killed", wait=False)
    deadline = time.monotonic() + 300
    while not list((trial / "checkpoints").glob("step-*")):  # kill as soon as the first checkpoint is whole
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()[-3000:]
        time.sleep(0.05)
    victim = rank_process(str(trial), 1)  # the generation rank, holding the rollout buffer
    assert victim is not None
    os.kill(victim.pid, signal.SIGKILL)
    output, _ = run.communicate(timeout=120)
    assert run.returncode != 0, output[-3000:]
    killed_at = read_log(trial).last_complete_step
    saved = int(last_checkpoint(trial).name.removeprefix("step-"))
    assert 2 <= saved <= killed_at < STEPS

    _ok(restage_run(tmp_path, "jobs/grpo_tiny.yaml", "-n", "2", "trial=killed", "--resume"))
    straight, resumed = read_log(tmp_path / "grpo-tiny" / "straight"), read_log(trial)
    assert resumed.last_complete_step == straight.last_complete_step == STEPS
    assert resumed.resumed_at_steps == [saved]
    a = hf_weights(last_checkpoint(tmp_path / "grpo-tiny" / "straight") / "actor" / "hf")
    b = hf_weights(last_checkpoint(trial) / "actor" / "hf")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    series_a, series_b = straight.stat_series(), resumed.stat_series()
    assert series_a.keys() == series_b.keys()
    for name in series_a:
        np.testing.assert_array_equal(series_a[name][1], series_b[name][1], err_msg=name)
    if job is ASYNC:
        np.testing.assert_array_equal(series_b["actor_train/version_gap_mean"][1], [0.0] + [1.0] * (STEPS - 1))
    else:  # answers cut at the checkpoint's step continued after the resume: some samples span two versions
        assert (series_b["actor_gen/mixed_version_samples"][1][saved:] > 0).any()
        assert (series_b["actor_train/version_gap_max"][1] <= 2).all()
