"""A lost node: read from scontrol, named by the driver, and the job requeued (tests/multinode does it for real)."""

import subprocess

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
