"""A lost node: read from scontrol, named by the driver, and the job requeued (tests/multinode does it for real)."""

import signal
import subprocess
import time

import pytest

from restage.errors import LaunchError
from restage.launch import allocation, job
from restage.launch.trial import TrialPaths, read_json, record_attempt

SCONTROL = ("NodeName=n1 Arch=x86_64 CoresPerSocket=2 State=ALLOCATED ThreadsPerCore=1\n"
            "NodeName=n2 Arch=x86_64 CoresPerSocket=2 State=ALLOCATED+NOT_RESPONDING ThreadsPerCore=1\n")


def test_lost_nodes_from_scontrol(monkeypatch):
    calls = []

    def fake_run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=SCONTROL, stderr="")

    monkeypatch.setattr(allocation.subprocess, "run", fake_run)
    assert allocation.node_states(["n1", "n2", "n3"]) == {"n1": "ALLOCATED", "n2": "ALLOCATED+NOT_RESPONDING", "n3": ""}
    assert allocation.lost_nodes(["n1", "n2"], wait_seconds=0) == {"n2": "ALLOCATED+NOT_RESPONDING"}
    assert calls[0] == ["scontrol", "-o", "show", "node", "n1,n2,n3"]


def test_the_driver_names_the_lost_node_and_requeues(tmp_path, monkeypatch, capsys):
    paths = TrialPaths(tmp_path)
    record_attempt(paths, job_id="7", restarts=0, resume=False, hosts=["n1", "n2"], launcher="mpirun", command="x")
    requeued = []
    monkeypatch.setattr(allocation, "node_states", lambda hosts: {"n1": "MIXED", "n2": "DOWN+NOT_RESPONDING"})
    monkeypatch.setattr(allocation, "requeue", lambda job_id: requeued.append(job_id) or False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    job._requeue_if_a_node_was_lost(paths, ["n1", "n2"], may_requeue=True)
    assert requeued == ["7"]
    assert read_json(paths.root / "job.json")["attempts"][0]["outcome"] == "lost node(s) n2 (DOWN+NOT_RESPONDING); requeued"
    assert "restage: lost node(s) n2 (DOWN+NOT_RESPONDING): requeueing job 7" in capsys.readouterr().out


def test_the_attempts_end_from_slurm(monkeypatch):
    assert allocation.job_end_seconds("7", {"SLURM_JOB_END_TIME": "1767225600"}) == 1767225600.0
    calls = []

    def squeue(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=squeue.out, stderr="")

    monkeypatch.setattr(allocation.subprocess, "run", squeue)
    squeue.out = "2026-01-31T12:00:00\n"  # local time, as squeue prints it
    assert allocation.job_end_seconds("7", {}) == time.mktime((2026, 1, 31, 12, 0, 0, 0, 0, -1))
    assert calls == [["squeue", "-h", "-j", "7", "-o", "%e"]]
    for no_limit in ("N/A\n", "Unknown\n", "NONE\n", ""):
        squeue.out = no_limit
        assert allocation.job_end_seconds("7", {}) is None


def test_ranks_stopped_for_the_time_limit_are_requeued_through_submitits_handler(tmp_path, monkeypatch, capsys):
    """The driver raises USR2 in itself (submitit's handler checkpoints and requeues); without a handler it says how
    to continue."""
    paths = TrialPaths(tmp_path)
    record_attempt(paths, job_id="7", restarts=0, resume=False, hosts=["n1"], launcher="mpirun", command="x")
    stopped = {"step": 12, "seconds_left": 16.0, "reason": "16 s left before the time limit < ..."}
    handled = []

    class Requeued(Exception):
        pass

    def handler(signum, frame):
        handled.append(signum)
        raise Requeued  # submitit's handler exits the driver (sys.exit) after the requeue

    previous = signal.signal(signal.SIGUSR2, handler)
    try:
        with pytest.raises(Requeued):
            job._requeue_before_time_limit(paths, stopped)
        assert handled == [signal.SIGUSR2]
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)
        with pytest.raises(LaunchError, match="stopped at step 12 before the time limit; submit again with --resume"):
            job._requeue_before_time_limit(paths, stopped)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert read_json(paths.root / "job.json")["attempts"][0]["outcome"] == (
        "stopped at step 12 before the time limit; submit again with --resume to continue")
    assert "restage: the ranks checkpointed at step 12 before the time limit (16 s left" in capsys.readouterr().out


def test_a_stop_for_the_time_limit_is_recorded_only_with_its_checkpoint(write_config, tmp_path):
    """The master writes TIME_LIMIT when it decides, before its checkpoint: when the driver's last resort stops the
    ranks during that write, the attempt resumes from the checkpoint before and is recorded as the last resort's."""
    import yaml

    from restage.runtime.checkpoint import checkpoint_dir
    from restage.runtime.control.deadline import StopBeforeDeadline, write_time_limit

    cfg = yaml.safe_load(write_config(slurm={"time_minutes": 1}).read_text())
    trial = tmp_path / "results" / "launch" / "t"
    paths = TrialPaths(trial)
    checkpoint_dir.begin(trial, 1)
    checkpoint_dir.commit(trial, 1, {}, keep=0)
    write_time_limit(trial, 2, StopBeforeDeadline(9.0, 0.0, 0.0, 55.0, by_config=True))
    checkpoint_dir.begin(trial, 2)  # the last resort stopped the ranks here: .partial-step-2
    outcomes = []
    for step_two_whole in (False, True):
        if step_two_whole:
            checkpoint_dir.commit(trial, 2, {}, keep=0)
        record_attempt(paths, job_id="7", restarts=len(outcomes), resume=bool(outcomes), hosts=["n1"],
                       launcher="mpirun", command="x")
        job.TrialJob().checkpoint(cfg, str(trial))
        outcomes.append(read_json(paths.job_record)["attempts"][-1]["outcome"])
    assert outcomes == ["requeued after checkpoint at step 1",
                        "requeued after checkpoint at step 2 before the time limit"]
    assert not job.stopped_for_time_limit(tmp_path, [])
