"""The data a trial trains on, kept with the trial (``<trial>/data.json``); ``--resume`` refuses changed data.

A run records the fingerprint (``data.fingerprint``: size, rows, content hash) of each file its data set reads
(``dataset.path``, and ``dataset.eval_path`` or ``dataset.eval_split`` where they hold out). ``--resume`` reads
the files again and compares: data that changed at the same path (a changed path is a config change,
``launch.resume``) is refused in one line naming the file and the difference, because the data cursor walks
rows by position and would now draw other rows. ``--accept-changed-data`` continues on the new data; the change
is appended to ``accepted_changes`` in ``data.json`` (when, from which checkpoint, what differed) and said in one
line.
"""

from __future__ import annotations

import time
from pathlib import Path

from restage.config.schema import ExperimentConfig
from restage.data.fingerprint import Fingerprint, difference, fingerprint
from restage.errors import ConfigError
from restage.launch.trial import read_json, write_json_atomic

DATA_FILE = "data.json"
ACCEPT_OPTION = "--accept-changed-data"


def data_sources(cfg: ExperimentConfig) -> dict[str, tuple[str, str]]:
    """Config key -> (path, split) of every file the data set reads."""
    ds = cfg.dataset
    sources = {"dataset.path": (ds.path, ds.split)}
    if ds.eval_path or ds.eval_split:
        sources["dataset.eval_path" if ds.eval_path else "dataset.eval_split"] = (ds.eval_path or ds.path,
                                                                                ds.eval_split or ds.split)
    return sources


def check_trial_data(trial_dir: Path, cfg: ExperimentConfig, resume: bool, accept_changed: bool,
                     resume_step: int | None = None) -> list[str]:
    """Fingerprint the data, compare it with the trial's record on ``resume`` (refusing a change unless
    ``accept_changed``), write the record; returns the lines to print."""
    began = time.monotonic()
    now = {key: fingerprint(path, split) for key, (path, split) in data_sources(cfg).items()}
    seconds = time.monotonic() - began
    path = trial_dir / DATA_FILE
    record = read_json(path) if resume else None
    lines: list[str] = []
    accepted = list(record.get("accepted_changes", [])) if record else []
    where = f"checkpoint step-{resume_step}" if resume_step is not None else "the checkpoint"
    if resume and record is None:
        lines.append(f"restage: --resume: {path} is missing (a trial from before restage kept one); recording the "
                     "current data's fingerprint, with nothing to compare it with")
    elif record is not None:
        changes = {key: difference(Fingerprint.from_dict(record["sources"][key]), fp)
                   for key, fp in now.items() if key in record.get("sources", {})}
        changes = {key: text for key, text in changes.items() if text}
        described = "; ".join(f"{key} {now[key].path} changed since {where} was trained on it: {text}"
                              for key, text in changes.items())
        if changes and not accept_changed:
            raise ConfigError(f"--resume: {described}; the data cursor walks rows by position, so it would now draw "
                              f"other rows: restore the data, start a new trial=NAME, or pass {ACCEPT_OPTION} to "
                              f"continue on the new data (recorded in {path})")
        if changes:
            accepted.append({"accepted": time.strftime("%Y-%m-%dT%H:%M:%S"), "checkpoint_step": resume_step,
                             "changes": changes, "before": {k: record["sources"][k] for k in changes}})
            lines.append(f"restage: {ACCEPT_OPTION}: continuing on changed data: {described} (recorded in {path})")
    write_json_atomic(path, {"sources": {key: fp.to_dict() for key, fp in now.items()},
                             "fingerprint_seconds": round(seconds, 3), "accepted_changes": accepted})
    return lines
