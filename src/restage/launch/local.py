"""``restage run CONFIG [-n NPROC] [--resume] [key=value ...]``: plan, then run every rank here under mpirun.

Everything a user can get wrong is checked before any rank starts: the config (keys, types),
the data set and model directories, the plan (layouts, memory) and the rank count. A run that
fails ends with one line naming the failed rank and its error.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from restage.cluster import load_cluster
from restage.config.load import config_from_dict
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError, LaunchError, LogError
from restage.launch import watchdog
from restage.launch.checks import load_job_config, plan_job, validate
from restage.launch.data_check import ACCEPT_OPTION, check_trial_data
from restage.launch.mpirun import mpirun_command
from restage.launch.resume import resumed_config, write_trial_overrides
from restage.launch.trial import trial_lock
from restage.report.journal import journal_path
from restage.report.log import read_log
from restage.runtime.checkpoint.checkpoint_dir import complete_steps, latest
from restage.runtime.control.failure import clear_failures, describe_failure
from restage.schedule.file import read_schedule, write_schedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML (jobs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument("-n", "--nproc", type=int, default=0,
                        help="ranks to start (default: run.nprocs, else the plan's cluster); "
                             "sets cluster.devices_per_node for the plan")
    parser.add_argument("--resume", action="store_true", help="continue from the trial's last checkpoint")
    parser.add_argument("--schedule", default="", help="use this schedule.json instead of planning")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing trial's log and checkpoints")
    parser.add_argument(ACCEPT_OPTION, action="store_true", dest="accept_changed_data",
                        help="--resume on data that changed since the checkpoint (recorded in the trial's data.json)")


def check_local_devices(cfg: ExperimentConfig, cuda_devices: int) -> str:
    """Refuse a GPU plan on a machine without CUDA; return a warning (or "") for a CPU plan on one with GPUs.

    The ranks ``restage run`` starts use this machine's CUDA devices whenever it has them
    (``restage.device.rank_device``), whatever cluster file the plan was costed for.
    """
    cluster = load_cluster(cfg.cluster.name, cfg.cluster.nodes, cfg.cluster.devices_per_node or None)
    if cluster.has_gpus and not cuda_devices:
        raise ConfigError(f"cluster.name={cluster.name} plans for {cluster.device} GPUs but this machine has no CUDA "
                          "device; set cluster.name=local-cpu to run here, or submit to GPU nodes (restage submit)")
    if cuda_devices and not cluster.has_gpus:
        return (f"warning: the ranks will run on this machine's {cuda_devices} CUDA device(s) with a plan costed for "
                f"cluster.name={cluster.name} ({cluster.device}); set cluster.name to a GPU cluster file (cluster/*.yaml) "
                "to plan for them")
    return ""


def prepare(cfg: ExperimentConfig) -> None:
    """One-line refusals for inputs that would otherwise fail inside the ranks (``checks.validate``, which
    ``restage submit`` runs too), and this machine's devices against the plan's."""
    warning = check_local_devices(cfg, torch.cuda.device_count())
    if warning:
        print(f"restage: {warning}", file=sys.stderr, flush=True)
    validate(cfg, plan=False)


def plan_trial(cfg: ExperimentConfig, trial_dir: Path) -> Path:
    return write_schedule(plan_job(cfg), trial_dir / "schedule.json")


def main(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.nproc and not args.resume:  # a resumed trial keeps its plan: -n need only match it (checked below)
        overrides += [f"run.nprocs={args.nproc}", f"cluster.devices_per_node={args.nproc}", "cluster.nodes=1"]
    cfg, overrides, notes = load_job_config(args.config, overrides)  # picks the trial; on --resume,
    for note in notes:  # resume.resumed_config decides the rest
        print(note, file=sys.stderr, flush=True)
    with trial_lock(cfg.trial_dir):  # before anything of the trial is read or written
        return _run(args, cfg, overrides)


def _run(args: argparse.Namespace, cfg: ExperimentConfig, overrides: list[str]) -> int:
    trial_dir = cfg.trial_dir
    log = trial_dir / "log.h5"
    saved = latest(trial_dir) is not None
    if args.resume and not saved:  # said here, before ranks start and fail to find one
        raise ConfigError(f"{trial_dir} has no checkpoint to resume from (no step of it was saved); run it without "
                          "--resume to start it afresh")
    recorded: list[str] | None = overrides
    if args.resume:
        cfg, recorded, applied = resumed_config(args.config, overrides, trial_dir, complete_steps(trial_dir)[-1])
        for line in applied:
            print(line, flush=True)
    fresh = args.overwrite and not args.resume
    if log.exists() and not (args.resume or args.overwrite):
        if saved:
            raise ConfigError(f"{trial_dir} already holds a run; pass --resume to continue it, --overwrite to replace "
                              "it, or choose another trial=NAME")
        if _completed_steps(log) > 0:
            raise ConfigError(f"{trial_dir} holds a run that saved no checkpoint; pass --overwrite to start it afresh "
                              "or choose another trial=NAME")
        print(f"restage: {trial_dir}: the earlier run ended before its first step; starting it afresh", flush=True)
        fresh = True
    if fresh:
        for stale in (log, journal_path(log), trial_dir / "checkpoints", trial_dir / "failures"):
            if stale.is_dir():
                shutil.rmtree(stale)
            elif stale.exists():
                stale.unlink()
    began = time.monotonic()
    print(f"restage: start-up: checking the config, data and models of {trial_dir}", flush=True)
    prepare(cfg)
    for line in check_trial_data(trial_dir, cfg, args.resume, args.accept_changed_data,
                                 complete_steps(trial_dir)[-1] if args.resume else None):
        print(line, flush=True)
    trial_dir.mkdir(parents=True, exist_ok=True)
    (trial_dir / "config.yaml").write_text(cfg.to_yaml())
    if recorded is not None:
        write_trial_overrides(trial_dir, recorded)
    if args.schedule:
        schedule = Path(args.schedule)
    elif args.resume and (trial_dir / "schedule.json").is_file():
        schedule = _with_config(trial_dir / "schedule.json", cfg)
    else:
        print(f"restage: start-up: planning (plan.mode={cfg.plan.mode})", flush=True)
        schedule = plan_trial(cfg, trial_dir)
        print(f"restage: start-up: planned in {time.monotonic() - began:.1f} s: {schedule}", flush=True)

    world = read_schedule(schedule).world_size
    nprocs = args.nproc or cfg.run.nprocs or world  # run.nprocs 0: as many as the plan's cluster gives
    if world != nprocs:
        raise ConfigError(f"the schedule needs {world} ranks but -n/run.nprocs is {nprocs}; make them equal")
    return launch(schedule, trial_dir, nprocs, resume=args.resume)


def _with_config(path: Path, cfg: ExperimentConfig) -> Path:
    """The trial's schedule, carrying ``cfg`` (the ranks read their config from it): on resume only keys that do
    not change the plan differ (resume.SAFE_ON_RESUME)."""
    schedule = read_schedule(path)
    if schedule.config != cfg.to_dict():
        write_schedule(dataclasses.replace(schedule, config=cfg.to_dict()), path)
    return path


def _completed_steps(log: Path) -> int:
    try:
        return read_log(log).last_complete_step  # steps count from 1
    except LogError:
        return 0  # a log that was never written past its header


def launch(schedule: Path, trial_dir: Path, nprocs: int, resume: bool = False) -> int:
    """Start the ranks; return 0 (or 128 + the signal that stopped them), or raise LaunchError with the failed
    rank's one line."""
    clear_failures(trial_dir)
    watchdog.clear_heartbeats(trial_dir)
    limits = watchdog.Limits.from_run(config_from_dict(read_schedule(schedule).config).run)
    preempt = trial_dir / "PREEMPT"
    preempt.unlink(missing_ok=True)  # a request belongs to the run that received it
    program = [sys.executable, "-m", "restage.runtime.spmd", str(schedule), "--trial-dir", str(trial_dir)]
    if resume:
        program.append("--resume")
    env = {"PYTHONUNBUFFERED": "1"}
    if os.environ.get("OMP_NUM_THREADS"):  # the user's wins; else each rank takes its share (control/threads.py)
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if "DS_ACCELERATOR" in os.environ:
        env["DS_ACCELERATOR"] = os.environ["DS_ACCELERATOR"]
    command = mpirun_command(nprocs, program, env=env)
    print(f"restage: start-up: starting {nprocs} rank(s) under mpirun", flush=True)
    full_env = {**os.environ, **env}
    # mpirun in a session of its own, so a terminal's Ctrl-C reaches only this launcher (which stops the ranks
    # at a step boundary), and killed with it, however it dies.
    process = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, preexec_fn=_die_with_parent)
    stop = _StopOnSignal(preempt, process)
    # A stalled rank (stopped, stuck) ends the job with its name, host and activity, from outside MPI.
    stalled = watchdog.guard(trial_dir, nprocs, limits, lambda: watchdog.end_session(process.pid),
                             say=lambda line: print(line, flush=True))
    tail: list[str] = []
    assert process.stdout is not None
    with stop.installed():
        for line in process.stdout:
            sys.stdout.write(line)
            tail = (tail + [line])[-200:]
        code = process.wait()
    stalled.set()
    preempt.unlink(missing_ok=True)
    if stop.signals:
        name = signal.Signals(stop.signals[0]).name
        how = ("after checkpointing at the end of its step" if code == 0 else
               "at once, without a checkpoint (the newest whole one stays)")
        print(f"restage: stopped on {name} {how}: {trial_dir}", file=sys.stderr, flush=True)
        return 128 + stop.signals[0]
    if code != 0:
        raise LaunchError(describe_failure(trial_dir, "".join(tail)))
    return 0


def _die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when this launcher exits (PR_SET_PDEATHSIG); mpirun
    then ends every rank."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG (linux/prctl.h)


class _StopOnSignal:
    """SIGINT or SIGTERM to the launcher: the first asks the ranks to checkpoint at the end of the step and stop
    (the PREEMPT file, as a SLURM preemption does; the master closes the log); a second stops them at once
    (SIGTERM to mpirun, which ends every rank)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, preempt: Path, process: subprocess.Popen):
        self.preempt, self.process = preempt, process
        self.signals: list[int] = []

    def __call__(self, signum, frame) -> None:
        self.signals.append(signum)
        name = signal.Signals(signum).name
        if len(self.signals) == 1:
            self.preempt.write_text(f"{name} to restage run (pid {os.getpid()})\n")
            print(f"restage: {name}: the ranks checkpoint at the end of this step and stop; "
                  f"send {name} again to stop them at once", file=sys.stderr, flush=True)
        else:
            self.process.send_signal(signal.SIGTERM)

    @contextlib.contextmanager
    def installed(self):
        previous = {s: signal.signal(s, self) for s in self.SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
