"""What the SLURM tests ask the queue (both clusters: the one ``SLURM_CONF`` in the environment names)."""

import subprocess
import time

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED", "GONE"}


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
