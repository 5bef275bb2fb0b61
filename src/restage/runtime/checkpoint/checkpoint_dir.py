"""Checkpoint directories that are whole or absent.

Every rank writes into ``checkpoints/.partial-step-N``; once all ranks are done (a barrier),
the master writes ``manifest.json`` and renames the directory to ``step-N``. Only directories
named ``step-N`` with a manifest count; partial ones are leftovers of a crash and are removed
by the next checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_root(trial_dir: str | Path) -> Path:
    return Path(trial_dir) / "checkpoints"


def partial_dir(trial_dir: str | Path, step: int) -> Path:
    return checkpoints_root(trial_dir) / f".partial-step-{step}"


def final_dir(trial_dir: str | Path, step: int) -> Path:
    return checkpoints_root(trial_dir) / f"step-{step}"


def begin(trial_dir: str | Path, step: int) -> Path:
    """Master: remove leftovers of an interrupted write and create the partial directory."""
    root = checkpoints_root(trial_dir)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".partial-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    path = partial_dir(trial_dir, step)
    path.mkdir()
    return path


def commit(trial_dir: str | Path, step: int, manifest: dict[str, Any], keep: int) -> Path:
    """Master, after every rank has written: seal the checkpoint and prune all but the newest ``keep``."""
    partial = partial_dir(trial_dir, step)
    manifest_path = partial / "manifest.json"
    manifest_path.write_text(json.dumps({"step": step, **manifest}, indent=1))
    with open(manifest_path) as handle:
        os.fsync(handle.fileno())
    final = final_dir(trial_dir, step)
    if final.exists():  # a re-run of the same step after resume replaces its own checkpoint
        shutil.rmtree(final)
    os.replace(partial, final)
    if keep > 0:
        for old in complete_steps(trial_dir)[:-keep]:
            shutil.rmtree(final_dir(trial_dir, old), ignore_errors=True)
    return final


def complete_steps(trial_dir: str | Path) -> list[int]:
    """Steps with a whole checkpoint, ascending."""
    root = checkpoints_root(trial_dir)
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / "manifest.json").is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest(trial_dir: str | Path) -> Path | None:
    steps = complete_steps(trial_dir)
    return final_dir(trial_dir, steps[-1]) if steps else None
