"""The files of one trial: ``results/<experiment>/<trial>/`` (docs/slurm.md has the full picture).

::

    config.yaml        the resolved config (absolute paths), written by the job before ranks start
    schedule.json      the execution plan for this trial's cluster (restage plan, run inside the job)
    submission.json    what `restage submit` / `restage sweep` submitted: job id, script, submitit folder
    data.json          the data's fingerprint (size, rows, content hash) and accepted changes (launch/data_check.py)
    job.json           one row per attempt of the job (requeues add rows): ids, hosts, launch line, outcome
    output.log         every rank's stdout and stderr, appended across attempts
    log.h5             the runtime's metrics log (master rank, steps from 1; restage.report.log); while
                       the run goes on, its steps are appended to log.h5.journal, folded in at the end
    checkpoints/       step-N/ whole checkpoints after N steps (restage.runtime.checkpoint.checkpoint_dir):
                       <model>/hf/ (transformers loads it), <model>/engine/, ranks/, manifest.json
    failures/          rank<N>.txt of a rank that raised (restage.runtime.control.failure)
    PREEMPT            present while the job asks the ranks to checkpoint and stop
    TIME_LIMIT         the ranks stopped at a checkpoint before the time limit (runtime/control/deadline.py): requeue
    .lease, .holder    the trial lock, held by the process that runs the trial for its whole life
                       (restage.locks: a lease, not an flock), and who holds it
    slurm/             submitit's folder for a single `restage submit`: sbatch script, SLURM stdout/err
                       (a sweep keeps one submitit folder for the whole array under the sweep directory)

The self-test program (``restage.launch.selftest``) keeps the same layout and adds ``selftest.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from restage.disk import replace_atomically
from restage.errors import LaunchError
from restage.locks import LEASE_SECONDS, HostLock


@dataclass(frozen=True)
class TrialPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def schedule(self) -> Path:
        return self.root / "schedule.json"

    @property
    def submission(self) -> Path:
        return self.root / "submission.json"

    @property
    def job_record(self) -> Path:
        return self.root / "job.json"

    @property
    def output_log(self) -> Path:
        return self.root / "output.log"

    @property
    def log_h5(self) -> Path:
        return self.root / "log.h5"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def preempt_file(self) -> Path:
        return self.root / "PREEMPT"

    @property
    def slurm_folder(self) -> Path:
        return self.root / "slurm"


def write_json_atomic(path: Path, data) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, (json.dumps(data, indent=1, default=str) + "\n").encode(), durable=False)


def read_json(path: Path, default=None):
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return default


def record_attempt(paths: TrialPaths, **fields) -> int:
    """Append one attempt row to job.json; returns its index (0 for the first start)."""
    record = read_json(paths.job_record, {"attempts": []})
    record["attempts"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields})
    write_json_atomic(paths.job_record, record)
    return len(record["attempts"]) - 1


def update_attempt(paths: TrialPaths, **fields) -> None:
    """Set fields (outcome, end time) on the newest attempt row."""
    record = read_json(paths.job_record, {"attempts": [{}]})
    record["attempts"][-1].update(fields)
    write_json_atomic(paths.job_record, record)


@contextlib.contextmanager
def trial_lock(root: Path, wait_seconds: float = LEASE_SECONDS * 1.5) -> Iterator[None]:
    """Hold the trial's lock (``root/.lease``, ``restage.locks.HostLock``) for the block: one run per trial (a
    second run would overwrite the first's schedule, log and checkpoints). A holder that died loses it at once on
    its own host; one on another host (a requeued job after its node died) is waited for up to ``wait_seconds``,
    until its lease runs out. The ``.holder`` file names the holder for the message a second run gets."""
    root.mkdir(parents=True, exist_ok=True)
    lock = HostLock(root, "")
    if not lock.try_acquire() and (lock.held_here_by_a_live_process() or not lock.wait(wait_seconds)):
        raise LaunchError(f"{root} is in use by {lock.holder()}; wait for that run to end or choose another "
                          "trial=NAME")
    job = os.environ.get("SLURM_JOB_ID")
    lock.name_holder((f" (SLURM job {job})" if job else "") + f" since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    try:
        yield
    finally:
        lock.release()
