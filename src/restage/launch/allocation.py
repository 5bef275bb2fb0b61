"""What SLURM says about this job's allocation: which of its nodes were lost, and when its time is up.

When a node dies mid-run (power, kernel, a killed slurmd), the launcher fails within seconds on
the survivors (their peers' sockets close), long before slurmctld marks the node DOWN. The driver
then asks SLURM for the allocation's nodes for a while: a node that stopped responding is named,
and the job is requeued so that it resumes from its last whole checkpoint on healthy nodes.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence

LOST_STATES = ("DOWN", "NOT_RESPONDING", "FAIL", "POWERED_DOWN", "NO_RESPOND")


def node_states(hosts: Sequence[str]) -> dict[str, str]:
    """``scontrol show node``'s State for each host ("" when scontrol cannot tell)."""
    done = subprocess.run(["scontrol", "-o", "show", "node", ",".join(hosts)], capture_output=True, text=True)
    states = {}
    for line in done.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if "NodeName" in fields:
            states[fields["NodeName"]] = fields.get("State", "")
    return {h: states.get(h, "") for h in hosts}


def lost_nodes(hosts: Sequence[str], wait_seconds: float, poll_seconds: float = 1.0) -> dict[str, str]:
    """The hosts SLURM reports as not responding or down, waiting up to ``wait_seconds`` for it to notice."""
    deadline = time.monotonic() + wait_seconds
    while True:
        lost = {h: s for h, s in node_states(hosts).items() if any(word in s.upper() for word in LOST_STATES)}
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(poll_seconds)


def requeue(job_id: str) -> bool:
    """Ask SLURM to requeue this job (it kills the batch step, this driver included)."""
    return subprocess.run(["scontrol", "requeue", job_id], capture_output=True).returncode == 0


def job_end_seconds(job_id: str, env: Mapping[str, str] | None = None) -> float | None:
    """When this attempt of the job reaches its time limit, in seconds since the epoch; None when it has none
    (UNLIMITED) or SLURM cannot say. A requeued job has a new end time, so each attempt asks again."""
    env = os.environ if env is None else env
    if env.get("SLURM_JOB_END_TIME", "").isdigit():  # Slurm >= 23.02 sets it in the job's environment
        return float(env["SLURM_JOB_END_TIME"])
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True)
    text = done.stdout.strip()
    try:  # SLURM prints local time, e.g. 2026-01-31T12:00:00; N/A, Unknown or NONE without a limit
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
