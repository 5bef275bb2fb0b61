"""Time limits and cancellation of a real job against the real SLURM: both end where an uninterrupted run ends.

The time-limit test does not wait for a real limit: SLURM's smallest limit is one minute and its
signal timer may fire up to a minute early, so a real-limit test would take minutes and be flaky.
The job's script asks for ``--signal=B:USR2@<signal_delay_seconds>``; when the limit approaches,
slurmctld does exactly what ``scancel --batch --signal=USR2 JOB`` does now: USR2 to the batch
step, where the driver runs. submitit counts that as a time-out (a limit under ten minutes always
is one) and requeues. SLURM then holds a requeued job for about two minutes (BeginTime); the test
lifts that with ``scontrol update StartTime=now``, once the wall clock is past the second of the
requeue: slurmd revokes the old incarnation's credential with a one-second timestamp and kills
a restart launched within that same second ("Job credential revoked"; it failed the test once).

Both tests run exactly the reference job's config (conftest.reference_overrides) and compare with
it: the same steps in the log, the same statistics at every step, bit-identical final weights.
Log steps count from 0; checkpoint ``step-N`` holds N finished steps.
"""

import json
import subprocess
import time

import pytest
import torch
from slurm_jobs import (
    REFERENCE_STEPS,
    SAVE_EVERY,
    failure_report,
    hf_tensors,
    job_state,
    log_rows,
    reference_overrides,
    slurm_output,
    stats_by_step,
    submit_real,
    wait_finished,
    wait_until,
)

from restage import cli
from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.runtime.checkpoint import checkpoint_dir

pytestmark = pytest.mark.slurm
TRAINED = ("actor", "critic")


def assert_same_run_as_reference(trial, reference_run, resumed_at: list[int]) -> None:
    reference_run.wait_completed()
    log, reference = read_log(trial / "log.h5"), read_log(reference_run.trial_dir / "log.h5")
    assert [int(s) for s in log.steps["step"]] == [int(s) for s in reference.steps["step"]] == list(range(1, REFERENCE_STEPS + 1))
    assert (log.closed, log.last_complete_step, log.resumed_at_steps) == (True, REFERENCE_STEPS, resumed_at)
    assert stats_by_step(log) == stats_by_step(reference)  # every statistic of every step, exactly
    final = checkpoint_dir.final_dir(trial, REFERENCE_STEPS)
    for model in TRAINED:
        mine, theirs = hf_tensors(final, model), hf_tensors(checkpoint_dir.final_dir(reference_run.trial_dir,
                                                                                   REFERENCE_STEPS), model)
        assert sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[name], theirs[name]) for name in mine), f"{model} weights differ"


def test_signal_at_time_limit_requeues_and_resumes_to_the_uninterrupted_run(reference_run, tmp_path):
    job_id, trial = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "requeued", *reference_overrides(),
                                "slurm.signal_delay_seconds=30")
    wait_until(lambda: len(log_rows(trial)) >= 2 or job_state(job_id) in ("FAILED", "COMPLETED"), 240,
               "two steps before the signal")
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    wait_until(lambda: job_state(job_id) in ("PENDING", "FAILED", "COMPLETED"), 90, "the job to be requeued")
    assert job_state(job_id) == "PENDING", failure_report(trial)
    done = log_rows(trial)
    stopped_after = len(done)
    assert done == list(range(1, stopped_after + 1)) and 2 <= stopped_after < REFERENCE_STEPS
    assert checkpoint_dir.complete_steps(trial)[-1] == stopped_after  # checkpointed at the stop, not before
    assert read_log(trial / "log.h5").closed  # the stop closed the log cleanly
    time.sleep(2.0)  # past the second in which slurmd revoked the old credential (see the module docstring)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    state = wait_finished(job_id)
    assert state == "COMPLETED", f"{state}:\n{failure_report(trial)}"
    assert_same_run_as_reference(trial, reference_run, resumed_at=[stopped_after])
    attempts = read_json(trial / "job.json")["attempts"]
    assert [(a["job_id"], a["restarts"], a["resume"]) for a in attempts] == [(job_id, 0, False), (job_id, 1, True)]
    assert [a["outcome"] for a in attempts] == [f"requeued after checkpoint at step {stopped_after}", "completed"]
    out = slurm_output(trial)
    assert "this job is timed-out" in out and f"Requeued job {job_id}" in out


def test_cancel_mid_run_leaves_a_readable_log_and_a_whole_checkpoint(reference_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    overrides = reference_overrides()
    job_id, trial = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "cancelled", *overrides)
    wait_until(lambda: checkpoint_dir.complete_steps(trial) or job_state(job_id) in ("FAILED", "COMPLETED"), 240,
               "the first checkpoint")
    assert cli.main(["cancel", str(trial)]) == 0
    assert f"cancelled 1 job(s): {job_id}" in capsys.readouterr().out
    assert wait_finished(job_id, 60) == "CANCELLED", failure_report(trial)

    latest = checkpoint_dir.latest(trial)  # whole: sealed with its manifest, every rank's state in it
    saved = int(latest.name.removeprefix("step-"))
    manifest = json.loads((latest / "manifest.json").read_text())
    assert manifest["step"] == saved and saved % SAVE_EVERY == 0 and saved < REFERENCE_STEPS
    assert sorted(p.name for p in (latest / "ranks").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert all((latest / model / "engine").is_dir() for model in TRAINED)
    actor = AutoModelForCausalLM.from_pretrained(latest / "actor" / "hf")  # transformers loads it as it is
    tensors = hf_tensors(latest, "actor")
    state = actor.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in tensors.items())
    with torch.no_grad():
        logits = actor(torch.tensor([[1, 5, 7, 3]])).logits
    assert logits.shape == (1, 4, actor.config.vocab_size) and torch.isfinite(logits).all()

    log = read_log(trial / "log.h5")  # readable after the kill; every step complete up to the last one
    assert not log.closed
    assert [int(s) for s in log.steps["step"]] == list(range(1, log.last_complete_step + 1))
    assert log.last_complete_step >= saved
    assert read_json(trial / "job.json")["attempts"][0]["job_id"] == job_id
    assert cli.main(["status", str(trial)]) == 0
    assert "CANCELLED" in capsys.readouterr().out

    # Intact means resumable: `restage submit --resume` continues from it and ends where the reference ends.
    job_id, _ = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "cancelled", *overrides, resume=True)
    state = wait_finished(job_id)
    assert state == "COMPLETED", f"{state}:\n{failure_report(trial)}"
    assert_same_run_as_reference(trial, reference_run, resumed_at=[saved])
