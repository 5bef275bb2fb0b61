"""``restage status TARGET`` and ``restage cancel TARGET``: thin over squeue and scancel.

TARGET is a trial directory (its ``submission.json``), a sweep directory (its ``index.json``) or an
experiment config (its trial directory). A job SLURM no longer lists is described from the
trial's own ``job.json`` (the outcome of its last attempt).
"""

from __future__ import annotations

import argparse
import subprocess
from dataclasses import dataclass
from pathlib import Path

from restage.config.load import load_config
from restage.errors import LaunchError
from restage.launch.trial import TrialPaths, read_json

_DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@dataclass(frozen=True)
class Entry:
    trial: str
    trial_dir: Path
    job_id: str


def entries(target: str) -> list[Entry]:
    """The submitted trials a status/cancel target names."""
    path = Path(target)
    if path.is_file() and path.suffix in (".yaml", ".yml"):
        cfg = load_config(path)
        path = Path(cfg.run.results_dir) / cfg.experiment / cfg.trial
    index = read_json(path / "index.json")
    if index is not None:
        return [Entry(e["trial"], Path(e["trial_dir"]), str(e["job_id"])) for e in index["trials"]]
    submission = read_json(TrialPaths(path).submission)
    if submission is not None:
        return [Entry(path.name, path, str(submission["job_id"]))]
    raise LaunchError(f"{target}: no submission.json or index.json there; give a trial or sweep directory "
                      f"that restage submit/sweep wrote, or its config")


def queue_states(job_ids: list[str]) -> dict[str, tuple[str, str, str]]:
    """job id -> (state, elapsed, nodes or reason) for the jobs SLURM still knows."""
    if not job_ids:
        return {}
    try:
        done = subprocess.run(["squeue", "-h", "-r", "--states=all", "-o", "%i|%T|%M|%R", "-j", ",".join(job_ids)],
                              capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise LaunchError("squeue not found: run restage status where the SLURM client commands are") from None
    states = {}
    for line in done.stdout.splitlines():
        parts = line.split("|")
        if len(parts) == 4:
            states[parts[0]] = (parts[1], parts[2], parts[3])
    return states


def _lookup(states: dict, job_id: str):
    # A pending array task may still be listed under the array ("12_[0-3]") before it is split.
    if job_id in states:
        return states[job_id]
    base = job_id.split("_")[0]
    return next((v for k, v in states.items() if k.startswith(f"{base}_[")), None)


def _recorded(trial_dir: Path) -> str:
    record = read_json(TrialPaths(trial_dir).job_record)
    if not record or not record.get("attempts"):
        return "not started"
    last = record["attempts"][-1]
    return last.get("outcome", "running or killed")


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="trial directory, sweep directory or experiment config")


def status_main(args: argparse.Namespace) -> int:
    rows = entries(args.target)
    states = queue_states(sorted({r.job_id for r in rows}))
    print(f"{'trial':<24} {'job':<12} {'state':<12} {'elapsed':<10} detail")
    for row in rows:
        found = _lookup(states, row.job_id)
        state, elapsed, where = found if found else ("-", "-", "")
        print(f"{row.trial:<24} {row.job_id:<12} {state:<12} {elapsed:<10} {where or _recorded(row.trial_dir)}"
              + (f" | {_recorded(row.trial_dir)}" if found and state in _DONE else ""))
    return 0


def add_cancel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="trial directory, sweep directory or experiment config")


def cancel_main(args: argparse.Namespace) -> int:
    rows = entries(args.target)
    states = queue_states(sorted({r.job_id for r in rows}))
    live = [r.job_id for r in rows if (s := _lookup(states, r.job_id)) is not None and s[0] not in _DONE]
    if not live:
        print("nothing to cancel: no job of this target is pending or running")
        return 0
    done = subprocess.run(["scancel", *live], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise LaunchError(f"scancel failed: {' '.join(done.stderr.split())}")
    print(f"cancelled {len(live)} job(s): {', '.join(live)}")
    return 0
