"""Report of a sweep: one row per trial with its config keys and throughput.

The sweep directory holds ``index.json``, written by ``restage sweep`` (restage.launch.sweep). Only
``read_sweep_index`` knows its format, so adapting to a change of that file touches one function::

    {"trials": [{"trial": "lr-sweep/000", "trial_dir": "/abs/or/relative", "values": {"models.actor.optim.lr": 1e-5}}, ...]}

``trial_dir`` (absolute, or relative to the sweep directory) holds the trial's ``log.h5``; ``values``
are the swept config keys. Synonyms read too: ``dir``/``results_dir``/``path`` for the directory,
``overrides``/``params`` for the values, ``name`` for the trial; a bare list of trials is accepted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from restage.errors import LogError, RestageError
from restage.report.log import read_log
from restage.report.summary import fmt_number, summarize, text_table

INDEX_NAME = "index.json"


@dataclass(frozen=True)
class SweepTrial:
    name: str
    run_dir: Path
    overrides: dict = field(default_factory=dict)


def read_sweep_index(sweep_dir: str | Path) -> list[SweepTrial]:
    """The trials listed in ``SWEEP_DIR/index.json``."""
    sweep_dir = Path(sweep_dir)
    index = sweep_dir / INDEX_NAME
    if not index.is_file():
        raise LogError(f"no {INDEX_NAME} in {sweep_dir}; give the directory `restage sweep` wrote")
    try:
        data = json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise LogError(f"{index} is not valid JSON ({err})") from None
    entries = data.get("trials") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise LogError(f"{index} lists no trials; expected {{\"trials\": [{{\"trial\", \"trial_dir\", \"values\"}}, ...]}}")
    trials = []
    for i, entry in enumerate(entries):
        folder = next((entry[k] for k in ("trial_dir", "dir", "results_dir", "path") if k in entry), None)
        if folder is None:
            raise LogError(f"{index}: trial {i} has no trial_dir; each trial needs the directory of its log")
        run_dir = Path(folder) if Path(folder).is_absolute() else sweep_dir / folder
        values = next((entry[k] for k in ("values", "overrides", "params") if k in entry), None) or {}
        name = next((entry[k] for k in ("name", "trial") if k in entry), Path(folder).name)
        trials.append(SweepTrial(str(name), run_dir, dict(values)))
    return trials


def sweep_rows(sweep_dir: str | Path, last_n: int = 20) -> list[dict]:
    """Per trial: name, overrides, status and the throughput numbers of its log (None where it has none)."""
    rows = []
    for trial in read_sweep_index(sweep_dir):
        row: dict[str, Any] = {"name": trial.name, "dir": str(trial.run_dir), "overrides": trial.overrides}
        try:
            summary = summarize(read_log(trial.run_dir), last_n)
        except RestageError as err:  # a trial that failed or has not started: a row saying why
            row.update(status=str(err), steps=0, samples_per_second=None, tokens_per_second=None,
                       tflops_per_device=None, mfu=None)
        else:
            overall = summary["throughput"]["all"]
            row.update(status="complete" if summary["closed"] else f"not closed, up to step {summary['last_complete_step']}",
                       steps=overall["steps"], samples_per_second=overall["samples_per_second"],
                       tokens_per_second=overall["tokens_per_second"], tflops_per_device=overall["tflops_per_device"],
                       mfu=overall["mfu"])
        rows.append(row)
    return rows


def format_sweep(rows: list[dict]) -> str:
    """One line per trial: its config keys, then throughput."""
    keys = list(dict.fromkeys(k for row in rows for k in row["overrides"]))
    table = [[row["name"], *(str(row["overrides"].get(k, "-")) for k in keys), str(row["steps"]),
              fmt_number(row["samples_per_second"], ".4f"), fmt_number(row["tokens_per_second"], ".2f"),
              fmt_number(row["tflops_per_device"], ".4f"), fmt_number(None if row["mfu"] is None else 100 * row["mfu"], ".3f"),
              row["status"]] for row in rows]
    header = ["trial", *keys, "steps", "samples/s", "tokens/s", "TFLOP/s/dev", "MFU %", "status"]
    return "\n".join(["sweep trials"] + text_table(header, table, left=(0, -1)))
