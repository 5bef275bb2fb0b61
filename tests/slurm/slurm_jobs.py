"""Submit self-test jobs to the local SLURM cluster and watch them (helpers for tests/slurm)."""

import json
import subprocess
import time
from pathlib import Path

import yaml

from restage import cli

REPO = Path(__file__).resolve().parents[2]
SELFTEST = {
    "experiment": "slurmtest",
    "algorithm": "sft",
    "trial": "t",
    "models": {"actor": {"path": "unused", "trainable": True}},
    "cluster": {"name": "local-cpu", "nodes": 1, "devices_per_node": 3},
    "run": {"steps": 4},
    "algo": {"selftest_sleep_seconds": 0.0},
    "slurm": {"template": "local", "program": "restage.launch.selftest", "time_minutes": 5},
}
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "GONE"}


def submit(config: Path, *overrides: str) -> str:
    assert cli.main(["submit", str(config), *overrides]) == 0
    data = yaml.safe_load(config.read_text())
    trial = Path(data["run"]["results_dir"]) / data["experiment"] / data.get("trial", "t")
    return json.loads((trial / "submission.json").read_text())["job_id"]


def job_state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-r", "--states=all", "-o", "%T", "-j", job_id],
                         capture_output=True, text=True).stdout.split()
    return out[0] if out else "GONE"


def wait_until(predicate, timeout_seconds: float, what: str, poll_seconds: float = 0.5):
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_seconds)
    raise AssertionError(f"timed out after {timeout_seconds:.0f} s waiting for {what}")


def wait_finished(job_id: str, timeout_seconds: float = 120) -> str:
    return wait_until(lambda: (s := job_state(job_id)) in FINISHED and s, timeout_seconds, f"job {job_id} to finish")


def slurm_output(trial_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((trial_dir / "slurm").glob("*_log.out")))


def by_hand(world_size: int, steps: int) -> int:
    return sum((rank + 1) * step for step in range(1, steps + 1) for rank in range(world_size))


def log_rows(trial_dir: Path) -> list[int]:
    """The steps log.h5 has as complete (read live, as restage report would)."""
    from restage.errors import LogError
    from restage.report.log import read_log

    try:
        return [int(step) for step in read_log(trial_dir / "log.h5").steps["step"]]
    except (LogError, OSError, KeyError):  # not created yet, or created but not yet initialised
        return []
