"""What runs inside the allocation: the job driver of one trial.

submitit runs ``TrialJob()(config_dict, trial_dir)`` in the batch step. The driver writes the
resolved config, plans the trial if the program needs a schedule, starts every rank with
mpirun or srun (``slurm.launcher``; ``auto`` as ``launch.resources`` decides) through
``restage.launch.rank``, copies their output to ``output.log`` and records each attempt in ``job.json``.

Time limits: the driver asks SLURM when this attempt ends and hands it to every rank as
``RESTAGE_DEADLINE``; the runtime's master checkpoints and stops at the last step boundary that
leaves time for its checkpoint (``restage.runtime.control.deadline``) and writes ``TIME_LIMIT``. The driver
then does what SLURM's pre-timeout signal would make it do: it raises ``USR2`` in itself, so
submitit's handler calls ``TrialJob.checkpoint`` and requeues the job (counted against
``slurm.max_requeues``). Preemption, and a time limit the deadline rule missed: SLURM sends ``USR2``
(``launch.slurm.signal_delay_seconds`` before the limit). ``TrialJob.checkpoint`` creates the trial's
``PREEMPT`` file and waits for the program to checkpoint and exit; submitit then requeues the job.
Either way the next attempt starts the program with ``RESTAGE_RESUME=1``.

The program contract (``restage.runtime.spmd`` or ``slurm.program`` / ``$RESTAGE_PROGRAM``):
``python -m MODULE <trial>/schedule.json`` on every rank, with RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK, CUDA_VISIBLE_DEVICES (the node's GPUs; the rank's own is index LOCAL_RANK), MASTER_ADDR/MASTER_PORT and
RESTAGE_RENDEZVOUS_HOST, RESTAGE_TRIAL_DIR, RESTAGE_CONFIG, RESTAGE_SCHEDULE, RESTAGE_RESUME
("1": load the newest whole checkpoint under checkpoints/ if there is one) and
RESTAGE_PREEMPT_FILE (when it exists, checkpoint at the next step boundary and exit 0), and under SLURM
RESTAGE_DEADLINE (the attempt's end, seconds since the epoch) when the job has a time limit.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from submitit.helpers import Checkpointable, DelayedSubmission

from restage.config.load import config_from_dict
from restage.errors import LaunchError
from restage.launch import allocation, watchdog
from restage.launch.geometry import job_geometry
from restage.launch.launcher import (
    RUNTIME_MODULE,
    allocation_hosts,
    cpus_per_rank,
    forwarded_names,
    interface_environment,
    launch_command,
    network_interface,
    node_launcher,
    program_module,
    rank_environment,
    rank_program,
    rendezvous,
)
from restage.launch.shared import check_shared_directory
from restage.launch.slurm import signal_delay_seconds
from restage.launch.trial import TrialPaths, record_attempt, trial_lock, update_attempt
from restage.runtime.checkpoint.checkpoint_dir import complete_steps
from restage.runtime.control.deadline import DEADLINE_ENV, TIME_LIMIT_FILE, read_time_limit
from restage.runtime.control.failure import clear_failures, describe_failure

COPY_DRAIN_SECONDS = 10.0  # after the launcher exits, how long its last output may take to reach output.log


def plan_trial(paths: TrialPaths) -> None:
    """Write schedule.json for this trial's own cluster size with ``restage plan``."""
    if importlib.util.find_spec("restage.plan.cli") is None:
        raise LaunchError(f"{paths.schedule} is missing and restage.plan.cli is not importable to plan it")
    done = subprocess.run([sys.executable, "-m", "restage.cli", "plan", str(paths.config)], capture_output=True, text=True)
    if done.returncode != 0 or not paths.schedule.is_file():
        last = (done.stderr.strip().splitlines() or ["no schedule written"])[-1]
        raise LaunchError(f"planning {paths.root.name} failed: {last}")


class _Launched:
    """A running launcher: its output goes to output.log and stdout; ``done`` is set when it has exited and its
    output has been copied."""

    def __init__(self, command: list[str], env: dict[str, str], log_path: Path):
        self.tail: deque[bytes] = deque(maxlen=200)
        self.done = threading.Event()
        self.returncode: int | None = None
        self._log = open(log_path, "ab", buffering=0)
        # A session of its own: the driver can stop the launcher and every rank it started at once.
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()
        threading.Thread(target=self._wait, daemon=True).start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None  # stdout=PIPE
        for line in iter(self.proc.stdout.readline, b""):
            self.tail.append(line)
            try:
                self._log.write(line)
            except OSError:  # a full disk: keep reading, or the launcher blocks on a full pipe and the job hangs
                pass
            sys.stdout.buffer.write(line)
            sys.stdout.flush()

    def _wait(self) -> None:
        # Only this thread waits on the process: a signal handler in the main thread must never
        # block on Popen's internal lock (see TrialJob.checkpoint).
        self.returncode = self.proc.wait()
        # done means the output is in too: output() is read for the failure's reason (and Open MPI's lost-daemon
        # line) right after. Bounded: a process the launcher left behind may hold the pipe open.
        self._copier.join(COPY_DRAIN_SECONDS)
        self.done.set()

    def stop(self, grace_seconds: float) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.done.wait(grace_seconds):
                return
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            grace_seconds = 10.0

    def output(self) -> str:
        return b"".join(self.tail).decode(errors="replace")


def _job_ids(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    keys = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID", "array_task_id": "SLURM_ARRAY_TASK_ID"}
    return {k: env[v] for k, v in keys.items() if env.get(v)}


def run_trial(config_dict: dict, trial_dir: str, resume: bool = False, holder: dict | None = None) -> dict:
    """Run one trial's ranks to the end; returns a summary. ``holder`` receives the running launcher."""
    with trial_lock(Path(trial_dir)):  # before anything of the trial is read or written
        return _attempt(config_dict, trial_dir, resume, holder)


def _attempt(config_dict: dict, trial_dir: str, resume: bool, holder: dict | None) -> dict:
    cfg = config_from_dict(config_dict)
    paths = TrialPaths(Path(trial_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(cfg.to_yaml())
    geometry = job_geometry(cfg)
    module = program_module(cfg)
    if module == RUNTIME_MODULE and not paths.schedule.is_file():
        plan_trial(paths)
    paths.preempt_file.unlink(missing_ok=True)  # a request belongs to the attempt that received the signal
    (paths.root / TIME_LIMIT_FILE).unlink(missing_ok=True)  # so does a stop for the time limit

    clear_failures(paths.root)
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    resume = resume or restarts > 0
    in_slurm = "SLURM_JOB_ID" in os.environ
    hosts = allocation_hosts() if in_slurm else None
    host, port = rendezvous(hosts or [socket.gethostname()], os.environ.get("SLURM_JOB_ID"))
    cpus = cpus_per_rank(cfg, geometry, os.environ, len(os.sched_getaffinity(0))) if in_slurm else None
    interface = network_interface(cfg)
    deadline = attempt_deadline(os.environ.get("SLURM_JOB_ID"))
    rank_env = {**rank_environment(paths, geometry, module, resume, host, port, cpus),
                **interface_environment(interface), **deadline}
    launcher = node_launcher(cfg.slurm.launcher)
    extra = shlex.split(os.environ.get(f"RESTAGE_{launcher.upper()}_ARGS", ""))
    command = launch_command(launcher, geometry, hosts, rank_program(module, paths.schedule),
                             forwarded_names({**os.environ, **rank_env}), extra, cpus, interface)
    attempt = record_attempt(paths, **_job_ids(), restarts=restarts, resume=resume, hosts=hosts or [],
                             launcher=launcher, command=shlex.join(command))
    if hosts is not None and len(hosts) > 1:
        try:
            check_shared_directory(paths.root, hosts)  # before any rank starts
        except LaunchError as err:
            update_attempt(paths, ended=time.strftime("%Y-%m-%dT%H:%M:%S"), outcome=f"refused: {err}")
            print(f"restage: {err}", flush=True)
            raise
    print(f"restage: attempt {attempt} of {paths.root} on {len(hosts or [1])} host(s): {shlex.join(command)}", flush=True)
    if module == RUNTIME_MODULE:  # its ranks write heartbeats (another program's may not)

        watchdog.clear_heartbeats(paths.root)
    launched = _Launched(command, {**os.environ, **rank_env}, paths.output_log)
    if holder is not None:
        holder["launched"] = launched
        if deadline:
            holder["deadline"] = float(deadline[DEADLINE_ENV])
    last_resort = _signal_before_deadline(float(deadline[DEADLINE_ENV])) if deadline else None
    stalled = None
    if module == RUNTIME_MODULE:  # a stalled rank ends the job, named with its host and activity
        stalled = watchdog.guard(paths.root, geometry.world_size, watchdog.Limits.from_run(cfg.run),
                                 lambda: launched.stop(0.0), say=lambda line: print(line, flush=True))
    while not launched.done.wait(1.0):
        pass
    if last_resort is not None:
        last_resort.cancel()
    if stalled is not None:
        stalled.set()
    if paths.preempt_file.exists():  # stopped on request; TrialJob.checkpoint records the outcome
        return {"trial_dir": str(paths.root), "attempt": attempt, "world_size": geometry.world_size, "preempted": True}
    returncode = launched.returncode
    if returncode == 0 and LOST_DAEMON in launched.output():
        returncode = 1  # Open MPI 5's mpirun exits 0 after losing a node's daemon (and the ranks there)
    stopped = read_time_limit(paths.root) if returncode == 0 else None
    if stopped is not None:  # the ranks checkpointed and stopped before the time limit: requeue (ends the driver)
        _requeue_before_time_limit(paths, stopped)
    if returncode != 0 and hosts is not None and len(hosts) > 1:
        _requeue_if_a_node_was_lost(paths, hosts, cfg.slurm.requeue)
    if returncode != 0:
        reason = describe_failure(paths.root, launched.output())
        update_attempt(paths, ended=time.strftime("%Y-%m-%dT%H:%M:%S"), outcome=f"failed ({returncode}): {reason}")
        raise LaunchError(f"{paths.root}: {reason}")
    update_attempt(paths, ended=time.strftime("%Y-%m-%dT%H:%M:%S"), outcome="completed")
    return {"trial_dir": str(paths.root), "attempt": attempt, "world_size": geometry.world_size}


def attempt_deadline(job_id: str | None) -> dict[str, str]:
    """``RESTAGE_DEADLINE`` for the ranks: this attempt's end (a requeued job has a new one); {} outside SLURM or
    without a time limit."""
    end = allocation.job_end_seconds(job_id) if job_id else None
    return {DEADLINE_ENV: f"{end:.0f}"} if end is not None else {}


LAST_RESORT_SECONDS = 8.0  # before the limit: ranks still running get PREEMPT, then are stopped, and the job requeued
REQUEUE_SECONDS = 3.0  # what the requeue needs of the time left (scontrol requeue; submitit's bookkeeping)


def _signal_before_deadline(deadline_seconds: float) -> threading.Timer | None:
    """The last resort when the ranks have not stopped by themselves (a start-up or a step that overran the
    deadline rule's estimates): LAST_RESORT_SECONDS before the limit the driver raises USR2 in itself, as SLURM's
    pre-timeout signal would, so the job is requeued from its newest checkpoint instead of ending TIMEOUT. Only
    under submitit, whose handler does the requeue."""
    if not callable(signal.getsignal(signal.SIGUSR2)):
        return None
    timer = threading.Timer(max(0.0, deadline_seconds - LAST_RESORT_SECONDS - time.time()),
                            lambda: os.kill(os.getpid(), signal.SIGUSR2))
    timer.daemon = True
    timer.start()
    return timer


def _requeue_before_time_limit(paths: TrialPaths, stopped: dict[str, Any]) -> None:
    """The ranks stopped at a checkpoint before the time limit: requeue the job through submitit's own handler of
    the pre-timeout signal (TrialJob.checkpoint records the attempt, submitit counts it against
    slurm.max_requeues and requeues), as if SLURM had sent it; outside submitit, say how to continue."""
    print(f"restage: the ranks checkpointed at step {stopped['step']} before the time limit ({stopped['reason']})",
          flush=True)
    if callable(signal.getsignal(signal.SIGUSR2)):
        signal.raise_signal(signal.SIGUSR2)  # the handler requeues the job and exits the driver
    message = f"stopped at step {stopped['step']} before the time limit; submit again with --resume to continue"
    update_attempt(paths, ended=time.strftime("%Y-%m-%dT%H:%M:%S"), outcome=message)
    raise LaunchError(f"{paths.root}: {message}")


LOST_DAEMON = "PRTE has lost communication with a remote daemon"
NODE_LOSS_WAIT_SECONDS = 30.0  # slurmctld marks a silent node after SlurmdTimeout; sites set 30-300 s


def _requeue_if_a_node_was_lost(paths: TrialPaths, hosts: Sequence[str], may_requeue: bool) -> None:
    """After a failed launch: if SLURM reports a node of the allocation lost, say which and requeue the job
    (it resumes from the last whole checkpoint); the requeue ends this driver."""
    lost = allocation.lost_nodes(hosts, float(os.environ.get("RESTAGE_NODE_LOSS_WAIT_SECONDS", NODE_LOSS_WAIT_SECONDS)))
    if not lost:
        return
    named = ", ".join(f"{h} ({s})" for h, s in lost.items())
    job_id = os.environ.get("SLURM_JOB_ID", "")
    will = may_requeue and job_id
    update_attempt(paths, ended=time.strftime("%Y-%m-%dT%H:%M:%S"),
                   outcome=f"lost node(s) {named}" + ("; requeued" if will else ""))
    print(f"restage: lost node(s) {named}: " + (f"requeueing job {job_id} to resume from the last checkpoint"
          if will else "slurm.requeue is off; resubmit with --resume"), flush=True)
    if will and allocation.requeue(job_id):
        time.sleep(120.0)  # SLURM ends this batch step now


def stopped_for_time_limit(trial_dir: Path, steps: Sequence[int]) -> bool:
    """Whether the ranks stopped at the newest whole checkpoint (``steps``) for the deadline rule. The master writes
    TIME_LIMIT when it decides, before the checkpoint is written: if the last resort stopped the ranks during that
    write (a step that ended a few seconds before the limit), the file names a step that has no checkpoint, and the
    job resumes from the one before, like any stop by the last resort."""
    stopped = read_time_limit(trial_dir)
    return stopped is not None and bool(steps) and stopped.get("step") == steps[-1]


class TrialJob(Checkpointable):
    """The submitit job: ``run_trial``, plus the checkpoint-and-requeue reaction to the pre-timeout signal."""

    def __init__(self) -> None:
        self._holder: dict = {}

    def __call__(self, config_dict: dict, trial_dir: str, resume: bool = False) -> dict:
        return run_trial(config_dict, trial_dir, resume, self._holder)

    def checkpoint(self, config_dict: dict, trial_dir: str, resume: bool = False) -> DelayedSubmission:
        """Runs inside submitit's signal handler: ask the ranks to checkpoint, wait, then let submitit requeue."""
        paths = TrialPaths(Path(trial_dir))
        paths.preempt_file.write_text(f"{time.time():.3f}\n")
        launched = self._holder.get("launched")
        slurm = config_from_dict(config_dict).slurm
        # Until the time-limit signal's end (a preemption's notice is the cluster's GraceTime, unknown here), and
        # never past the limit itself: the requeue must happen before SLURM ends the job.
        grace = max(5.0, (signal_delay_seconds(slurm) or slurm.signal_delay_seconds) - 15.0)
        if "deadline" in self._holder:
            grace = min(grace, max(1.0, self._holder["deadline"] - REQUEUE_SECONDS - time.time()))
        if launched is not None:
            launched.stop(grace)

        steps = complete_steps(paths.root)
        update_attempt(paths, ended=time.strftime("%Y-%m-%dT%H:%M:%S"),
                       outcome=f"requeued after checkpoint at step {steps[-1] if steps else 'none'}"
                       + (" before the time limit" if stopped_for_time_limit(paths.root, steps) else ""))
        print(f"restage: {paths.root} checkpointed (steps {steps[-1:]}) and asks SLURM to requeue it", flush=True)
        return DelayedSubmission(TrialJob(), config_dict, trial_dir, resume=True)
