"""The HDF5 run log (``log.h5``): ``LogWriter`` for the master rank, ``read_log`` for everyone else.

Layout of format version 2 (docs/report.md has the full table):

* four resizable (chunked, ``maxshape=None``) compound datasets, one row per record:
  ``steps`` (one row per completed step), ``mfcs`` (one row per MFC per rank per step),
  ``transfers`` (reallocations and data transfers) and ``stats`` (long format
  ``step, name, value``, so new statistics can appear at any step);
* root attributes: ``format_version``, ``world_size``, ``dtype``, ``config``, ``schedule``,
  ``cluster``, ``versions`` (text, JSON but for the config), ``created_unix_seconds``,
  ``resumed_at_steps`` (JSON list), ``last_complete_step`` and ``closed``.

Steps count from 1, as in the progress line and in checkpoint names: step N is the Nth completed
step, ``last_complete_step`` is 0 while none is, and a run resumed from checkpoint ``step-N``
keeps the rows of steps up to N. Version 1 logs counted from 0; ``read_log`` shifts them by one,
and a resumed run's writer upgrades its version 1 log in place.

Crash safety uses plain ``flush`` rather than SWMR: SWMR forbids creating attributes and
objects after it starts and leaves a file that ordinary readers refuse after a crash. The writer
keeps the rows of the step in flight in memory and touches the file only in ``end_step``: it
appends every table, flushes, then sets ``last_complete_step`` and flushes again. A SIGKILL
between two ``end_step`` calls therefore finds the file exactly as last flushed; a kill inside
the flush window can leave rows of the step in flight, which the reader drops because their
step is past ``last_complete_step``. ``closed`` is set only by a clean ``close()``.
HDF5 file locking is off on both sides, so a live log can be read (by ``restage report``, or by
the master itself) while it is written; one writer per log is the runtime's rule.

Times are seconds on the master's clock (each rank corrects its own by an offset measured at
start-up, ``runtime.clock``); the report only ever uses differences, within a rank for durations
and against the step's start for the timeline.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from restage.errors import LogError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1 counted steps from 0
LOG_NAME = "log.h5"
_STR = h5py.string_dtype("utf-8")
_CHUNK_ROWS = 1024

STEP_DTYPE = np.dtype([("step", "i8"), ("start_seconds", "f8"), ("end_seconds", "f8"),
                       ("samples", "i8"), ("tokens", "i8"), ("flops", "f8")])
MFC_DTYPE = np.dtype([("step", "i8"), ("name", _STR), ("model", _STR), ("kind", _STR), ("rank", "i4"),
                      ("start_seconds", "f8"), ("end_seconds", "f8"), ("tokens", "i8"), ("flops", "f8"),
                      ("peak_memory_bytes", "i8")])
TRANSFER_DTYPE = np.dtype([("step", "i8"), ("kind", _STR), ("name", _STR), ("src", _STR), ("dst", _STR),
                           ("rank", "i4"), ("num_bytes", "i8"), ("start_seconds", "f8"), ("end_seconds", "f8")])
STAT_DTYPE = np.dtype([("step", "i8"), ("name", _STR), ("value", "f8")])
TABLES = {"steps": STEP_DTYPE, "mfcs": MFC_DTYPE, "transfers": TRANSFER_DTYPE, "stats": STAT_DTYPE}
TRANSFER_KINDS = ("realloc", "transfer")
VERSIONED_PACKAGES = ("restage", "torch", "deepspeed", "h5py", "numpy", "mpi4py", "transformers", "matplotlib")


def package_versions() -> dict[str, str]:
    """Installed versions of the packages a run depends on (without importing them)."""
    import platform

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


def _check_version(handle: h5py.File, path: Path) -> int:
    version = handle.attrs.get("format_version")
    if version is None:
        raise LogError(f"{path} has no format_version attribute; it was not written by restage's LogWriter")
    if int(version) not in READABLE_VERSIONS:
        raise LogError(f"{path} is log format version {int(version)}, this restage reads versions "
                       f"{', '.join(map(str, READABLE_VERSIONS))}; report it with the restage release that wrote it")
    return int(version)


def _upgrade_v1(handle: h5py.File) -> None:
    """Renumber a version 1 log's steps (from 0) as version 2's (from 1), in place."""
    for name in TABLES:
        rows = handle[name][:]
        if len(rows):
            rows["step"] += 1
            handle[name][:] = rows
    attrs = handle.attrs
    attrs["last_complete_step"] = int(attrs["last_complete_step"]) + 1
    attrs["resumed_at_steps"] = json.dumps([s + 1 for s in json.loads(attrs.get("resumed_at_steps", "[]"))])
    attrs["format_version"] = FORMAT_VERSION


class LogWriter:
    """Append-only writer of ``log.h5``, used by the master rank only.

    ``path`` is the log file (``*.h5``) or the run directory that gets ``log.h5``.
    Record the rows of a step with ``mfc``, ``realloc``, ``transfer`` and ``stats``, then call
    ``end_step``, which writes them and flushes. Steps count from 1. ``resume_step=k`` reopens an
    existing log (a run resumed from its checkpoint ``step-k``): rows of steps after k are dropped first.
    """

    def __init__(self, path: str | Path, *, world_size: int, config: Any = None, schedule: Any = None,
                 cluster: Any = None, versions: dict[str, str] | None = None, dtype: str = "",
                 resume_step: int | None = None, overwrite: bool = False):
        self.path = Path(path)
        self.world_size = int(world_size)
        if self.path.suffix != ".h5":  # a run directory
            self.path = self.path / LOG_NAME
        self._pending: dict[str, list[tuple]] = {name: [] for name in TABLES}
        if resume_step is not None and self.path.exists():
            self._file = h5py.File(self.path, "a", locking=False)
            if _check_version(self._file, self.path) == 1:
                _upgrade_v1(self._file)
            self._truncate_after(resume_step)
            resumed = json.loads(self._file.attrs.get("resumed_at_steps", "[]")) + [int(resume_step)]
            self._file.attrs["resumed_at_steps"] = json.dumps(resumed)
        else:
            if self.path.exists() and not overwrite and resume_step is None:
                raise LogError(f"{self.path} already exists; resume the run or give it a new results directory")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = h5py.File(self.path, "w", locking=False)
            for name, dtype_ in TABLES.items():
                self._file.create_dataset(name, shape=(0,), maxshape=(None,), dtype=dtype_, chunks=(_CHUNK_ROWS,))
            self._file.attrs["format_version"] = FORMAT_VERSION
            self._file.attrs["created_unix_seconds"] = time.time()
            self._file.attrs["last_complete_step"] = 0  # steps count from 1
            self._file.attrs["resumed_at_steps"] = "[]"
            for key in ("config", "schedule", "cluster"):
                self._file.attrs[key] = ""
        self._tables = {name: self._file[name] for name in TABLES}  # looked up once: h5py's lookup is slow
        attrs = self._file.attrs
        attrs["world_size"] = int(world_size)
        attrs["closed"] = False
        if dtype or "dtype" not in attrs:
            attrs["dtype"] = dtype
        for key, value in (("config", config), ("schedule", schedule), ("cluster", cluster)):
            if value is not None:
                attrs[key] = _text(value)
        attrs["versions"] = _text(package_versions() if versions is None else versions)
        self.last_complete_step = int(attrs["last_complete_step"])
        self._file.flush()

    def _truncate_after(self, step: int) -> None:
        for name in TABLES:
            data = self._file[name]
            rows = data[:]
            keep = rows[rows["step"] <= step]
            if len(keep) != len(rows):
                data.resize((len(keep),))
                data[:] = keep
        last = min(int(self._file.attrs["last_complete_step"]), int(step))
        self._file.attrs["last_complete_step"] = last
        self._file.flush()

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
        """Close ``step``: append its row and every row recorded for it, flush, then mark it complete."""
        step = self._check_step(step)
        self._pending["steps"].append((step, float(start_seconds), float(end_seconds), int(samples), int(tokens),
                                       float(flops)))
        for name, rows in self._pending.items():
            stray = sorted({row[0] for row in rows} - {step})
            if stray:
                raise ValueError(f"{name} rows of steps {stray} recorded while closing step {step}; "
                                 f"close each step before recording the next")
        for name, rows in self._pending.items():
            if rows:
                _append(self._tables[name], np.array(rows, dtype=TABLES[name]))
            rows.clear()
        self._file.flush()
        # Marked only once the rows are on disk, so a reader never trusts a half-written step.
        self._file.attrs["last_complete_step"] = step
        self._file.flush()
        self.last_complete_step = step

    def close(self) -> None:
        """Mark the log as cleanly closed (the run ended normally) and close the file."""
        if self._file.id.valid:
            self._file.attrs["closed"] = True
            self._file.close()

    def abort(self) -> None:
        """Close the file without marking it closed: the report will say the run did not finish."""
        if self._file.id.valid:
            self._file.close()

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


@dataclass(frozen=True)
class RunLog:
    """Everything in a log, up to its last complete step. Tables are numpy structured arrays, strings decoded."""

    path: Path
    format_version: int
    world_size: int
    dtype: str
    config: str
    schedule: dict | None
    cluster: dict | None
    versions: dict
    last_complete_step: int
    closed: bool
    resumed_at_steps: list[int]
    steps: np.ndarray
    mfcs: np.ndarray
    transfers: np.ndarray
    stats: np.ndarray
    dropped_rows: int  # rows of the step in flight when the writer stopped

    @property
    def crashed(self) -> bool:
        return not self.closed

    def stat_series(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Each statistic's (steps, values), in step order."""
        series = {}
        for name in dict.fromkeys(self.stats["name"].tolist()):
            rows = self.stats[self.stats["name"] == name]
            order = np.argsort(rows["step"], kind="stable")
            series[name] = (rows["step"][order], rows["value"][order])
        return series


def _json_attr(attrs, key: str) -> dict | None:
    text = attrs.get(key, "")
    return json.loads(text) if text else None


def _decoded(rows: np.ndarray) -> np.ndarray:
    """Replace variable-length byte strings by unicode columns, which numpy compares and groups directly."""
    fields = []
    for name in rows.dtype.names:
        column = rows[name]
        if column.dtype == object:
            text = [v.decode() if isinstance(v, bytes) else str(v) for v in column]
            column = np.array(text, dtype=f"U{max((len(t) for t in text), default=1) or 1}")
        fields.append((name, column))
    out = np.empty(len(rows), dtype=[(name, column.dtype) for name, column in fields])
    for name, column in fields:
        out[name] = column
    return out


def resolve_log_path(path: str | Path) -> Path:
    """``RUN_DIR`` or ``RUN_DIR/log.h5`` to the log file, refusing a path with no log."""
    path = Path(path)
    candidate = path / LOG_NAME if path.is_dir() else path
    if not candidate.is_file():
        raise LogError(f"no {LOG_NAME} at {path}; give a run directory that holds {LOG_NAME} or the file itself")
    return candidate


def read_log(path: str | Path) -> RunLog:
    """Read a log, keeping only rows of completed steps. Safe on a log whose writer is still running or died."""
    path = resolve_log_path(path)
    try:
        # locking=False: a running (or SIGKILLed) writer may still hold the HDF5 file lock.
        handle = h5py.File(path, "r", locking=False)
    except OSError as err:
        raise LogError(f"{path} is not a readable HDF5 file ({err}); was it written by restage?") from None
    with handle:
        version = _check_version(handle, path)
        shift = 1 if version == 1 else 0  # version 1 counted steps from 0
        attrs = handle.attrs
        last = int(attrs["last_complete_step"]) + shift
        tables, dropped = {}, 0
        for name in TABLES:
            rows = handle[name][:]
            rows["step"] += shift
            keep = rows["step"] <= last
            dropped += int((~keep).sum())
            tables[name] = _decoded(rows[keep])
        return RunLog(
            path=path, format_version=version, world_size=int(attrs["world_size"]),
            dtype=str(attrs.get("dtype", "")), config=str(attrs.get("config", "")),
            schedule=_json_attr(attrs, "schedule"), cluster=_json_attr(attrs, "cluster"),
            versions=_json_attr(attrs, "versions") or {}, last_complete_step=last, closed=bool(attrs["closed"]),
            resumed_at_steps=[s + shift for s in json.loads(attrs.get("resumed_at_steps", "[]"))], dropped_rows=dropped,
            **tables)


def _append(data, rows: np.ndarray) -> None:
    """Append ``rows`` (already of the table's dtype) to a 1-D resizable dataset.

    Through h5py's low-level write: ``data[start:] = rows`` re-inspects the compound dtype field
    by field on every call. With the tables looked up once, a step's log write went from 2.9 ms
    to 1.1 ms (a tiny CPU GRPO step is ~65 ms, and the master writes between steps).
    """
    start = data.shape[0]
    data.resize((start + len(rows),))
    file_space = data.id.get_space()
    file_space.select_hyperslab((start,), (len(rows),))
    data.id.write(h5py.h5s.create_simple((len(rows),)), file_space, rows)
