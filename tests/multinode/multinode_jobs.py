"""Helpers for tests/multinode: submit the shipped tiny PPO job to the multinode cluster of
scripts/slurm_multinode.sh (nodes rmn1..rmn3, each a slurmd in its own network namespace with its own host name
and two stub GPUs) across two nodes with two ranks each, and watch it."""

import contextlib
import json
import os
from pathlib import Path

import yaml
from slurm_queue import FINISHED, job_state, wait_until  # noqa: F401 (the tests import them from here)

from restage import cli

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_multinode.sh"
CLUSTER_DIR = Path(os.environ.get("RESTAGE_MULTINODE_DIR", "/var/tmp/restage-multinode"))
SLURM_CONF = CLUSTER_DIR / "slurm.conf"
NODES, RANKS_PER_NODE = 2, 2
STEPS, SAVE_EVERY = 6, 2  # a node is killed after the step-2 checkpoint, four steps before the end
# Four ranks: generation and inference in dp4, the actor trains in dp2 x tp2 (tp inside a node), the critic in dp4.
PLAN4 = ("plan.mode=manual", "plan.layouts.actor_gen=ranks:0-3 dp4", "plan.layouts.ref_inf=ranks:0-3 dp4",
         "plan.layouts.critic_inf=ranks:0-3 dp4", "plan.layouts.actor_train=ranks:0-3 dp2tp2",
         "plan.layouts.critic_train=ranks:0-3 dp4")


def placement(results: Path, trial: str, launcher: str, nodes: int = NODES,
              ranks_per_node: int = RANKS_PER_NODE) -> list[str]:
    """Where a job runs on the multinode cluster: its trial, nodes x ranks per node, launcher and interface."""
    return [f"run.results_dir={results}", f"trial={trial}", "cluster.name=multinode-test", f"cluster.nodes={nodes}",
            f"cluster.devices_per_node={ranks_per_node}", f"run.nprocs={nodes * ranks_per_node}",
            "slurm.template=generic", "slurm.network_interface=eth0", f"slurm.launcher={launcher}",
            "slurm.time_minutes=20"]


def overrides(results: Path, trial: str, launcher: str, *more: str) -> list[str]:
    return [*placement(results, trial, launcher), f"run.steps={STEPS}", f"run.save_every={SAVE_EVERY}", *PLAN4, *more]


def submit(results: Path, trial: str, launcher: str, *more: str, config: str = "jobs/ppo_tiny.yaml") -> tuple[str, Path]:
    return submit_job(results, trial, config, overrides(results, trial, launcher, *more))


def submit_job(results: Path, trial: str, config: str, args: list[str]) -> tuple[str, Path]:
    """``restage submit config *args`` (args name the trial and results directory); (job id, trial directory)."""
    with contextlib.chdir(REPO):
        assert cli.main(["submit", config, *args]) == 0
    experiment = yaml.safe_load((REPO / config).read_text())["experiment"]
    trial_dir = results / experiment / trial
    return json.loads((trial_dir / "submission.json").read_text())["job_id"], trial_dir


def wait_finished(job_id: str, timeout_seconds: float = 900) -> str:
    return wait_until(lambda: (s := job_state(job_id)) in FINISHED and s, timeout_seconds, f"job {job_id} to finish", 1.0)


def slurm_output(trial_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((trial_dir / "slurm").glob("*_log.out")))


def failure_report(trial_dir: Path) -> str:
    log = trial_dir / "output.log"
    text = log.read_text(errors="replace") if log.is_file() else slurm_output(trial_dir)
    return "\n".join(text.splitlines()[-40:])


def rank_facts(trial_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((trial_dir / "rank-facts").glob("rank*.json"),
                                                     key=lambda p: int(p.stem[4:]))]


def node_address(name: str) -> str:
    import socket

    return socket.gethostbyname(name)


def hf_tensors(checkpoint, model: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted((checkpoint / model / "hf").glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors under {checkpoint / model / 'hf'}"
    return tensors
