"""``LogWriter``: the master rank's append-only writer of the run log (``log.h5`` and its journal; the format and
why it is written this way: ``report/log.py``)."""

from __future__ import annotations

import json
import platform
import secrets
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from restage.disk import replace_atomically, writing
from restage.errors import LogError
from restage.report import journal
from restage.report.log import FORMAT_VERSION, LOG_NAME, TABLES, load_contents

_CHUNK_ROWS = 1024
VERSIONED_PACKAGES = ("restage", "torch", "deepspeed", "h5py", "numpy", "mpi4py", "transformers", "matplotlib")


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a run depends on (without importing them)."""
    found = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def _text(value: Any) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True)


class LogWriter:
    """Append-only writer of ``log.h5`` and its journal, used by the master rank only.

    ``path`` is the log file (``*.h5``) or the run directory that gets ``log.h5``.
    Record the rows of a step with ``mfc``, ``realloc``, ``transfer`` and ``stats``, then call
    ``end_step``, which appends them to the journal as one line. Steps count from 1. ``resume_step=k``
    reopens an existing log (a run resumed from its checkpoint ``step-k``): rows of steps after k are dropped first.
    A write that finds the disk full raises ``DiskFullError``; every step before it stays readable.
    """

    def __init__(self, path: str | Path, *, world_size: int, config: Any = None, schedule: Any = None,
                 cluster: Any = None, versions: dict[str, str] | None = None, dtype: str = "",
                 resume_step: int | None = None, overwrite: bool = False):
        self.path = Path(path)
        self.world_size = int(world_size)
        if self.path.suffix != ".h5":  # a run directory
            self.path = self.path / LOG_NAME
        self._pending: dict[str, list[tuple]] = {name: [] for name in TABLES}
        # Told each step's rows once they are in the journal, and when the log closes (report/dashboards.py).
        self.observers: list = []
        if resume_step is not None and self.path.exists():
            contents = load_contents(self.path)
            tables = {name: rows[rows["step"] <= resume_step] for name, rows in contents.tables.items()}
            attrs = dict(contents.attrs)
            attrs["resumed_at_steps"] = json.dumps(json.loads(attrs.get("resumed_at_steps", "[]")) + [int(resume_step)])
            attrs["last_complete_step"] = min(contents.last_complete_step, int(resume_step))
        else:
            if self.path.exists() and not overwrite and resume_step is None:
                raise LogError(f"{self.path} already exists; resume the run or give it a new results directory")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tables = {name: np.empty(0, dtype=dtype_) for name, dtype_ in TABLES.items()}
            attrs = {"created_unix_seconds": time.time(), "last_complete_step": 0, "resumed_at_steps": "[]",
                     "config": "", "schedule": "", "cluster": ""}
        attrs.update(format_version=FORMAT_VERSION, world_size=int(world_size), closed=False,
                     journal_id=secrets.token_hex(8), versions=_text(package_versions() if versions is None else versions))
        if dtype or "dtype" not in attrs:
            attrs["dtype"] = dtype
        for key, value in (("config", config), ("schedule", schedule), ("cluster", cluster)):
            if value is not None:
                attrs[key] = _text(value)
        self._attrs = attrs
        self.last_complete_step = int(attrs["last_complete_step"])
        self._journal_path = journal.journal_path(self.path)
        self._journal: journal.Appender | None = None
        with writing("the run log", self.path):
            # The snapshot first: until the journal of its id exists, a reader ignores the old journal.
            _write_snapshot(self.path, attrs, tables)
            journal.create(self._journal_path, attrs["journal_id"])
            self._journal = journal.Appender(self._journal_path)

    def _check_step(self, step: int) -> int:
        step = int(step)
        if step < 1:
            raise ValueError(f"step {step}: steps count from 1 (step N is the Nth completed step)")
        if step <= self.last_complete_step:
            raise ValueError(f"step {step} is already complete in the log (last complete step {self.last_complete_step})")
        return step

    def mfc(self, step: int, name: str, model: str, kind: str, rank: int, start_seconds: float, end_seconds: float,
            tokens: int = 0, flops: float = 0.0, peak_memory_bytes: int = 0) -> None:
        """One MFC as run on one rank: its start and end on that rank, tokens and FLOPs it did, peak memory."""
        self._pending["mfcs"].append((self._check_step(step), name, model, kind, int(rank), float(start_seconds),
                                      float(end_seconds), int(tokens), float(flops), int(peak_memory_bytes)))

    def realloc(self, step: int, model: str, src: str, dst: str, num_bytes: int, start_seconds: float,
                end_seconds: float, rank: int = -1) -> None:
        """A parameter reallocation of ``model`` between layouts (strings as ``str(Layout)``); rank -1: whole group."""
        self._move("realloc", step, model, src, dst, num_bytes, start_seconds, end_seconds, rank)

    def transfer(self, step: int, key: str, src: str, dst: str, num_bytes: int, start_seconds: float,
                 end_seconds: float, rank: int = -1) -> None:
        """A data transfer of one output ``key`` from one MFC's layout to another's; rank -1: whole group."""
        self._move("transfer", step, key, src, dst, num_bytes, start_seconds, end_seconds, rank)

    def _move(self, kind, step, name, src, dst, num_bytes, start_seconds, end_seconds, rank) -> None:
        self._pending["transfers"].append((self._check_step(step), kind, name, str(src), str(dst), int(rank),
                                           int(num_bytes), float(start_seconds), float(end_seconds)))

    def stats(self, step: int, values: dict[str, float]) -> None:
        """Named scalar statistics of a step (loss, reward, kl, ...); a name may first appear at any step."""
        step = self._check_step(step)
        self._pending["stats"].extend((step, str(name), float(value)) for name, value in values.items())

    def end_step(self, step: int, start_seconds: float, end_seconds: float, samples: int, tokens: int,
                 flops: float = 0.0) -> None:
        """Close ``step``: append its row and every row recorded for it to the journal, as one line."""
        step = self._check_step(step)
        if self._journal is None:
            raise ValueError(f"{self.path} is closed; step {step} was not written")
        self._pending["steps"].append((step, float(start_seconds), float(end_seconds), int(samples), int(tokens),
                                       float(flops)))
        for name, rows in self._pending.items():
            stray = sorted({row[0] for row in rows} - {step})
            if stray:
                self._pending["steps"].pop()
                raise ValueError(f"{name} rows of steps {stray} recorded while closing step {step}; "
                                 f"close each step before recording the next")
        entry = {"step": step, **{name: list(pending) for name, pending in self._pending.items()}}
        line = journal.encode(entry)
        for pending in self._pending.values():
            pending.clear()
        with writing(f"the run log (step {step})", self._journal_path):
            self._journal.append(line)
        self.last_complete_step = step
        for observer in self.observers:
            observer.step(entry)

    def close(self) -> None:
        """Fold the journal into ``log.h5``, mark it cleanly closed (the run ended normally) and remove the journal."""
        if self._journal is None:
            return
        self._journal.close()
        self._journal = None
        self._close_observers()
        contents = load_contents(self.path)
        attrs = {**self._attrs, "closed": True, "journal_id": "", "last_complete_step": contents.last_complete_step}
        with writing("the run log (folding its journal into log.h5)", self.path):
            _write_snapshot(self.path, attrs, contents.tables)
        self._journal_path.unlink(missing_ok=True)

    def abort(self) -> None:
        """Stop writing without marking the log closed: the report will say the run did not finish."""
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        self._close_observers()

    def _close_observers(self) -> None:
        for observer in self.observers:
            observer.close()
        self.observers = []

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _write_snapshot(path: Path, attrs: dict, tables: dict[str, np.ndarray]) -> None:
    """Replace ``path`` whole by an HDF5 file of ``tables`` and ``attrs`` (temporary file, fsync, rename).

    The file is built in memory and written with one plain write: a full disk is then one clean ``OSError``,
    where HDF5 writing to disk would leave half-closed objects that complain again when collected.
    """
    with h5py.File(path.name, "w", driver="core", backing_store=False, locking=False) as handle:
        for name, dtype_ in TABLES.items():
            handle.create_dataset(name, data=_encodable(tables[name], dtype_), maxshape=(None,), chunks=(_CHUNK_ROWS,))
        for key, value in attrs.items():
            handle.attrs[key] = value
        handle.flush()
        image = handle.id.get_file_image()
    replace_atomically(path, image)


def _encodable(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``rows`` in the table's dtype, variable-length strings as ``str`` (HDF5 gives them back as bytes)."""
    out = np.empty(len(rows), dtype=dtype)
    assert dtype.names is not None, "the log's tables are structured arrays"
    for name in dtype.names:
        column = rows[name]
        if dtype[name].kind == "O":
            column = np.array([v.decode() if isinstance(v, bytes) else str(v) for v in column], dtype=object)
        out[name] = column
    return out
