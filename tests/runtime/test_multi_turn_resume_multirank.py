"""A multi-turn run killed in the middle of its episodes resumes by the documented rule (docs/algorithms.md,
"Multi-turn episodes", Modes): an episode in flight is restarted from its prompt with its step's seeds, so the
resumed run ends exactly where an uninterrupted one does: the same statistics at every step and the same weights
(issue 31). The environment (``graded_env.Graded``) holds an episode at its second step once the step-1 checkpoint
is whole; the test then SIGKILLs every process of the run, and resumes it without the hold. Both modes run in make
test-scale (make test's time bound): sync about 45 s on 2 cores, async, where the killed generation rank held
episodes generated ahead, about 130 s."""

import signal
import time

import numpy as np
import psutil
import pytest
from runs import ROOT, hf_weights, last_checkpoint, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.scale]  # make test's time bound

STEPS = 3
JOB = [str(ROOT / "jobs" / "grpo_calculator_tiny.yaml"), f"run.steps={STEPS}", "environment.name=graded_env:Graded",
       "run.batch_size=4", "algo.group_size=4", "dataset.eval_fraction=0"]
MODES = {"sync": ["-n", "1"],
         "async": ["-n", "2", "plan.execution=async", "plan.mode=manual", "plan.layouts.actor_gen=ranks:1-1 dp1",
                   "plan.layouts.actor_prox=ranks:0-0 dp1", "plan.layouts.actor_train=ranks:0-0 dp1"]}


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _kill_tree(process) -> None:
    root = psutil.Process(process.pid)
    for proc in [*root.children(recursive=True), root]:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_multi_turn_run_killed_mid_episode_resumes_to_the_uninterrupted_runs_steps_and_weights(tmp_path, mode):
    job = [*JOB, *MODES[mode]]
    _ok(restage_run(tmp_path, *job, "trial=straight"))
    trial, marks = tmp_path / "grpo-calculator-tiny" / "killed", tmp_path / "marks"
    marks.mkdir()
    hold = {"GRADED_HANG_AFTER": str(trial / "checkpoints" / "step-1"), "GRADED_HANG_MARK": str(marks)}
    run = restage_run(tmp_path, *job, "run.save_every=1", "trial=killed", env=hold, wait=False)
    deadline = time.monotonic() + 300
    while not any(marks.iterdir()):  # an episode is held between its first and second answer
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()[-3000:]
        time.sleep(0.05)
    _kill_tree(run)
    run.communicate(timeout=60)
    saved = int(last_checkpoint(trial).name.removeprefix("step-"))
    assert saved >= 1 and read_log(trial).last_complete_step < STEPS

    _ok(restage_run(tmp_path, str(ROOT / "jobs" / "grpo_calculator_tiny.yaml"), *MODES[mode][:2], "trial=killed",
                    "--resume", env={"GRADED_HANG_AFTER": "", "GRADED_HANG_MARK": ""}))
    straight, resumed = read_log(tmp_path / "grpo-calculator-tiny" / "straight"), read_log(trial)
    assert resumed.last_complete_step == straight.last_complete_step == STEPS
    assert resumed.resumed_at_steps == [saved]
    series_a, series_b = straight.stat_series(), resumed.stat_series()
    assert series_a.keys() == series_b.keys() and "actor_gen/turns" in series_a
    assert (series_a["actor_gen/turns"][1] == 3).all()  # every episode plays its three turns
    # The episodes are the same token for token: every generation statistic (turns, answer and observation
    # tokens, calls, rewards) is equal. Their log-probs are equal up to the float rounding of which episodes
    # shared a decode step (that depends on when tools return, in any run), so training's figures and the
    # weights agree to that rounding.
    for name in series_a:
        if name.startswith("actor_gen/") and not name.endswith(("seconds", "_s")):
            np.testing.assert_array_equal(series_a[name][1], series_b[name][1], err_msg=name)
        else:
            np.testing.assert_allclose(series_a[name][1], series_b[name][1], rtol=1e-4, atol=1e-6, err_msg=name)
    a = hf_weights(last_checkpoint(tmp_path / "grpo-calculator-tiny" / "straight") / "actor" / "hf")
    b = hf_weights(last_checkpoint(trial) / "actor" / "hf")
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < 1e-5, worst
