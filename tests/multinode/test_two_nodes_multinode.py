"""The tiny PPO job across two nodes of the multinode cluster (scripts/slurm_multinode.sh), two ranks each.

Through both launch paths (srun with PMIx, chosen by slurm.launcher=auto, and mpirun), each job asking for whole
nodes: every rank's host, local rank, device index (the one DeepSpeed's set_device(LOCAL_RANK) and the runtime use
among the node's GPUs, which SLURM's GRES gives as CUDA_VISIBLE_DEVICES=0,1), CPU set (task/affinity: one core of
its own per rank) and rendezvous host (the first node, never localhost). Then a results directory the nodes do not
share is refused before any rank starts, and a whole node killed mid-run ends the job, which SLURM requeues and
which resumes to the same final weights as the uninterrupted run.
Timings are printed (pytest -s) for the report.
"""

import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import torch
from multinode_jobs import (
    CLUSTER_DIR,
    NODES,
    RANKS_PER_NODE,
    SCRIPT,
    STEPS,
    failure_report,
    hf_tensors,
    job_state,
    node_address,
    rank_facts,
    slurm_output,
    submit,
    wait_finished,
    wait_until,
)

from restage.launch.trial import read_json
from restage.runtime.checkpoint import checkpoint_dir

pytestmark = pytest.mark.multinode
TRAINED = ("actor", "critic")
RUNS: dict[str, tuple[str, object, float]] = {}


def two_node_run(launcher: str, tmp_path_factory):
    if launcher not in RUNS:
        start = time.monotonic()
        job_id, trial = submit(tmp_path_factory.mktemp(launcher) / "results", launcher, launcher)
        state = wait_finished(job_id)
        assert state == "COMPLETED", f"job {job_id} ended {state}:\n{failure_report(trial)}"
        RUNS[launcher] = (job_id, trial, time.monotonic() - start)
    return RUNS[launcher]


@pytest.mark.parametrize("launcher", ["auto", "mpirun"])
def test_ppo_tiny_on_two_nodes_places_every_rank(launcher, tiny_model, tmp_path_factory):
    """auto (the default): this cluster's srun offers PMIx, so the ranks start under srun. Either way the job
    asks for whole nodes: --exclusive, --mem=0 and the node's 2 CPUs / 2 ranks per task."""
    job_id, trial, wall_seconds = two_node_run(launcher, tmp_path_factory)
    attempt = read_json(trial / "job.json")["attempts"][0]
    print(f"\nmultinode: {launcher} job {job_id}, {STEPS} PPO steps on 2 nodes x 2 ranks: "
          f"{wall_seconds:.1f} s from submission to completion; hosts {attempt['hosts']}")
    assert attempt["outcome"] == "completed"
    launcher = {"auto": "srun"}.get(launcher, launcher)
    assert attempt["launcher"] == launcher
    script = Path(read_json(trial / "submission.json")["script"]).read_text()
    flags = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S*))?$", script, re.M))
    assert "exclusive" in flags and (flags["mem"], flags["cpus-per-task"], flags["time"]) == ("0", "1", "20")
    hosts = attempt["hosts"]
    assert len(hosts) == NODES and len(set(hosts)) == NODES
    facts = rank_facts(trial)
    assert [f["rank"] for f in facts] == list(range(NODES * RANKS_PER_NODE))
    for f in facts:
        node, local = divmod(f["rank"], RANKS_PER_NODE)
        assert f["host"] == hosts[node]  # block placement, and each node has its own host name
        assert (f["node_rank"], f["local_rank"]) == (node, local)
        assert f["cuda_visible_devices"] == "0,1"  # all of the node's (stub) GPUs, as SLURM's GRES set them
        assert f["device_index"] == local  # DeepSpeed's set_device(LOCAL_RANK): the rank's own GPU
        if launcher == "mpirun":
            assert f["ompi_local_rank"] == str(f["local_rank"])  # DeepSpeed asserts this under mpirun
        assert f["cpus"] and f["omp_num_threads"] == str(len(f["cpus"]))
        assert f["rendezvous_host"] == f["master_addr"] == hosts[0]
        assert node_address(f["rendezvous_host"]).startswith("10.77.0.")  # the first node's, never localhost
        assert (f["gloo_socket_ifname"], f["nccl_socket_ifname"]) == ("eth0", "eth0")  # the pinned interface
    for node in range(NODES):
        cpus = [set(f["cpus"]) for f in facts if f["node_rank"] == node]
        assert all(cpus) and not cpus[0] & cpus[1]  # distinct cores per rank on a node
    final = checkpoint_dir.final_dir(trial, STEPS)
    assert all(hf_tensors(final, model) for model in TRAINED)
    if launcher == "mpirun":
        assert "--mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0" in attempt["command"]
        assert "--map-by slot:PE=1 --bind-to core" in attempt["command"]
    else:
        assert "--cpus-per-task=1 --cpu-bind=cores" in attempt["command"]


def test_a_results_directory_the_nodes_do_not_share_is_refused(tiny_model):
    """$CLUSTER_DIR/unshared is the host's directory on rmn1 (where the driver runs) and a private one on the
    other nodes (see scripts/slurm_multinode.sh)."""
    results = CLUSTER_DIR / "unshared" / uuid.uuid4().hex
    job_id, trial = submit(results, "unshared", "srun", "slurm.program=restage.launch.selftest")
    assert wait_finished(job_id, 120) == "FAILED"
    attempt = read_json(trial / "job.json")["attempts"][0]
    hosts = attempt["hosts"]
    assert hosts[0] == "rmn1"
    refusals = [ln for ln in slurm_output(trial).splitlines() if ln.startswith("restage: the trial directory")]
    assert refusals == [f"restage: the trial directory {trial} is not shared by every node: {', '.join(hosts[1:])} "
                        "do(es) not see the file the driver wrote there; set run.results_dir to a directory all nodes "
                        "mount (NFS, Lustre, ...)"]
    assert attempt["outcome"] == "refused: " + refusals[0].removeprefix("restage: ")
    assert not (trial / "rank-facts").exists() and not (trial / "output.log").exists()  # no rank started


def rank_pids(node: str) -> list[int]:
    """The rank processes running in a node's network namespace."""
    out = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in out:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"restage.launch.rank" in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def test_killing_a_node_requeues_and_resumes_to_the_uninterrupted_weights(tiny_model, tmp_path, tmp_path_factory):
    _, reference, _ = two_node_run("mpirun", tmp_path_factory)
    job_id, trial = submit(tmp_path / "results", "nodeloss", "mpirun")
    wait_until(lambda: checkpoint_dir.complete_steps(trial) or job_state(job_id) in ("FAILED", "COMPLETED"), 300,
               "the first checkpoint")
    hosts = read_json(trial / "job.json")["attempts"][0]["hosts"]
    survivor, victim = hosts
    assert rank_pids(survivor), "no rank runs on the first node"
    killed = time.monotonic()
    try:
        subprocess.run(["bash", str(SCRIPT), "kill-node", victim], check=True)
        wait_until(lambda: not rank_pids(survivor), 60, f"every rank on {survivor} to exit")
        ranks_gone_seconds = time.monotonic() - killed
        wait_until(lambda: job_state(job_id) != "RUNNING", 60, "the job to end")
        job_ended_seconds = time.monotonic() - killed
        print(f"\nmultinode: killed {victim}: every rank exited after {ranks_gone_seconds:.1f} s, "
              f"the job ended after {job_ended_seconds:.1f} s")
        first = read_json(trial / "job.json")["attempts"][0]
        assert first["outcome"].startswith(f"lost node(s) {victim} ("), first["outcome"]
        assert first["outcome"].endswith("; requeued")
        assert f"restage: lost node(s) {victim} (" in slurm_output(trial)
    finally:
        subprocess.run(["bash", str(SCRIPT), "start-node", victim], check=True)
        subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=RESUME"], capture_output=True)
    wait_until(lambda: job_state(job_id) == "PENDING" or job_state(job_id) in ("RUNNING", "COMPLETED"), 60,
               "the requeued job")
    time.sleep(2.0)  # past the second in which slurmd revoked the old credential (tests/slurm/test_requeue_slurm.py)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
    state = wait_finished(job_id)
    assert state == "COMPLETED", f"{state}:\n{failure_report(trial)}"
    attempts = read_json(trial / "job.json")["attempts"]
    assert [(a["restarts"], a["resume"]) for a in attempts] == [(0, False), (1, True)]
    assert attempts[1]["outcome"] == "completed"
    final, theirs = checkpoint_dir.final_dir(trial, STEPS), checkpoint_dir.final_dir(reference, STEPS)
    for model in TRAINED:
        mine, ref = hf_tensors(final, model), hf_tensors(theirs, model)
        assert sorted(mine) == sorted(ref)
        assert all(torch.equal(mine[name], ref[name]) for name in mine), f"{model} weights differ"
