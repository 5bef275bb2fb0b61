"""Time limits and cancellation against the real SLURM.

The time-limit test does not wait for a real limit: SLURM's smallest limit is one minute and its
signal timer may fire up to a minute early, so a real-limit test would take minutes and be flaky.
The job's script asks for ``--signal=B:USR2@<signal_delay_seconds>``; when the limit approaches,
slurmctld does exactly what ``scancel --batch --signal=USR2 JOB`` does now: USR2 to the batch
step, where the driver runs. submitit counts that as a time-out (the job ran past 80% of its
allowance, which with a tiny limit is always true) and requeues. SLURM then holds a requeued job
for about two minutes (BeginTime); the test lifts that with ``scontrol update StartTime=now``.
"""

import json
import subprocess

import pytest
from slurm_jobs import by_hand, job_state, log_rows, slurm_output, submit, wait_finished, wait_until

from restage import cli
from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.runtime import checkpoint_dir

pytestmark = pytest.mark.slurm


def test_signal_at_time_limit_requeues_and_resumes_to_the_same_steps(selftest_config, tmp_path):
    steps = 30
    config = selftest_config(cluster={"devices_per_node": 2}, run={"steps": steps}, algo={"selftest_sleep_seconds": 0.2},
                             slurm={"time_minutes": 3, "signal_delay_seconds": 30})
    job_id = submit(config)
    trial = tmp_path / "results" / "slurmtest" / "t"
    wait_until(lambda: len(log_rows(trial)) >= 3, 120, "three steps before the signal")
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True)
    wait_until(lambda: job_state(job_id) == "PENDING", 60, "the job to be requeued")
    stopped_at = log_rows(trial)[-1]
    assert 3 <= stopped_at < steps
    assert checkpoint_dir.complete_steps(trial)[-1] == stopped_at  # checkpointed at the stop, not before
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    assert wait_finished(job_id, 180) == "COMPLETED"
    result = read_json(trial / "selftest.json")
    assert result["resumed_from"] == stopped_at
    assert result["steps"] == steps
    assert result["sum_torch"] == result["sum_mpi"] == by_hand(2, steps)  # what an uninterrupted run adds up to
    log = read_log(trial / "log.h5")
    assert [int(s) for s in log.steps["step"]] == list(range(1, steps + 1))  # each step once across the attempts
    assert (log.closed, log.last_complete_step, log.resumed_at_steps) == (True, steps, [stopped_at])
    last = {row["name"]: row["value"] for row in log.stats if row["step"] == steps}
    assert last == {"sum_torch": by_hand(2, steps), "sum_mpi": by_hand(2, steps)}
    attempts = read_json(trial / "job.json")["attempts"]
    assert [(a["job_id"], a["restarts"], a["resume"]) for a in attempts] == [(job_id, 0, False), (job_id, 1, True)]
    assert [a["outcome"] for a in attempts] == [f"requeued after checkpoint at step {stopped_at}", "completed"]
    out = slurm_output(trial)
    assert "this job is timed-out" in out and f"Requeued job {job_id}" in out


def test_cancel_mid_run_leaves_the_last_checkpoint_whole(selftest_config, tmp_path, capsys):
    config = selftest_config(cluster={"devices_per_node": 2}, run={"steps": 500, "save_every": 3},
                             algo={"selftest_sleep_seconds": 0.1})
    job_id = submit(config)
    trial = tmp_path / "results" / "slurmtest" / "t"
    wait_until(lambda: len(log_rows(trial)) >= 8, 120, "eight steps")
    assert cli.main(["cancel", str(trial)]) == 0
    assert f"cancelled 1 job(s): {job_id}" in capsys.readouterr().out
    assert wait_finished(job_id, 60) == "CANCELLED"
    latest = checkpoint_dir.latest(trial)
    assert latest is not None
    state = json.loads((latest / "state.json").read_text())
    manifest = json.loads((latest / "manifest.json").read_text())
    assert manifest["step"] == state["step"] == int(latest.name.removeprefix("step-"))
    assert state["step"] % 3 == 0 and state["step"] <= log_rows(trial)[-1]
    assert state["sum_mpi"] == state["sum_torch"] == by_hand(2, state["step"])
    log = read_log(trial / "log.h5")  # readable after the kill, every step complete up to the last one
    assert not log.closed
    assert [int(s) for s in log.steps["step"]] == list(range(1, log.last_complete_step + 1))
    assert log.last_complete_step >= state["step"]
    assert read_json(trial / "job.json")["attempts"][0]["job_id"] == job_id
    assert "selftest.json" not in {p.name for p in trial.iterdir()}
    assert cli.main(["status", str(trial)]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    assert "restage: attempt 0" in slurm_output(trial)
