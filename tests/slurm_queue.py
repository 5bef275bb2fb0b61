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


def pending_reason(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-r", "--states=all", "-o", "%T %r", "-j", job_id],
                         capture_output=True, text=True).stdout.split()
    return out[1] if len(out) > 1 and out[0] == "PENDING" else ""


def finish_through_requeues(job_id: str, timeout_seconds: float) -> tuple[str, int]:
    """Wait for a job that requeues itself to finish: each time SLURM holds it after a requeue (BeginTime, about two
    minutes) release it at once, past the second of the requeue (slurmd revokes the old credential with a one-second
    timestamp; tests/slurm/test_requeue_slurm.py). Returns (the final state, how many holds were released)."""
    deadline = time.monotonic() + timeout_seconds
    released = 0
    while time.monotonic() < deadline:
        state = job_state(job_id)
        if state in FINISHED:
            return state, released
        if pending_reason(job_id) == "BeginTime":
            time.sleep(2.0)
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True)
            released += 1
            wait_until(lambda: pending_reason(job_id) != "BeginTime", 30, f"job {job_id} released")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_seconds:.0f} s waiting for job {job_id} to finish")
