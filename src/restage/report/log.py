"""The run log (``log.h5`` and its journal): its format and ``read_log`` for everyone; ``log_writer.LogWriter`` for
the master rank.

Layout of format version 2 (docs/report.md has the full table):

* ``log.h5``, an HDF5 *snapshot*: four compound datasets, one row per record: ``steps`` (one row
  per completed step), ``mfcs`` (one row per MFC per rank per step), ``transfers`` (reallocations
  and data transfers) and ``stats`` (long format ``step, name, value``, so new statistics can appear
  at any step); root attributes ``format_version``, ``world_size``, ``dtype``, ``config``,
  ``schedule``, ``cluster``, ``versions`` (text, JSON but for the config), ``created_unix_seconds``,
  ``resumed_at_steps`` (JSON list), ``last_complete_step``, ``closed`` and ``journal_id``;
* ``log.h5.journal``, an append-only text file: a header line ``restage-log-journal <journal_id>``,
  then one line per completed step after the snapshot, ``<crc32 hex> <JSON of the step's rows>``.

Why a journal: HDF5 rewrites its own metadata (superblock end-of-allocation, chunk indexes, the
heap of variable-length strings) in place, so a write cut short by SIGKILL or by a full disk could
damage the rows of *earlier* steps ("actual len exceeds EOA"); a preallocated HDF5 file cannot hold
strings or statistics that appear mid-run without growing. So the file being appended to is never
HDF5: a step is one line appended with a single ``write``, earlier bytes are never touched, and a
reader stops at the first line that is incomplete or fails its checksum. ``log.h5`` is only ever
replaced whole (written to a temporary file, fsynced, renamed): when the writer opens (a new log,
or a resume, which drops the steps after the checkpoint) and when it closes cleanly (every
journal step folded in, ``closed`` set, the journal removed). A journal whose id is not the
snapshot's belongs to a replaced log and is ignored. A step costs one ``write`` (no fsync: a killed
process loses nothing written; a machine crash may lose the last steps, never earlier ones).
A write that finds the disk full raises ``DiskFullError`` (one line) and leaves the journal as it
was before that step.

Steps count from 1, as in the progress line and in checkpoint names: step N is the Nth completed
step, ``last_complete_step`` is 0 while none is, and a run resumed from checkpoint ``step-N`` keeps
the rows of steps up to N. Format version 1 logs (rows appended to ``log.h5`` in place, steps
counted from 0) are still read: ``read_log`` adds one to their step numbers, and a resumed run's
writer rewrites such a log as version 2.

Times are seconds on the master's clock (each rank corrects its own by an offset measured at
start-up, ``runtime.control.clock``); the report only ever uses differences, within a rank for durations
and against the step's start for the timeline.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from restage.errors import LogError
from restage.report import journal

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # version 1: rows appended to log.h5 in place, no journal, steps from 0
LOG_NAME = "log.h5"
_STR = h5py.string_dtype("utf-8")

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


def _check_version(attrs, path: Path) -> int:
    version = attrs.get("format_version")
    if version is None:
        raise LogError(f"{path} has no format_version attribute; it was not written by restage's LogWriter")
    if int(version) not in READABLE_VERSIONS:
        raise LogError(f"{path} is log format version {int(version)}, this restage reads versions "
                       f"{', '.join(map(str, READABLE_VERSIONS))}; report it with the restage release that wrote it")
    return int(version)


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
    assert rows.dtype.names is not None, "the log's tables are structured arrays"
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


@dataclass(frozen=True)
class LogContents:
    """A log's snapshot and journal merged: attributes as written, rows (strings not yet decoded) of complete steps."""

    attrs: dict
    tables: dict[str, np.ndarray]
    last_complete_step: int
    dropped_rows: int


def load_contents(path: Path) -> LogContents:
    """Read the snapshot, then the journal of its id. ``log.h5`` is replaced whole by an opening or closing writer:
    if that happened while reading, read again."""
    for _ in range(3):
        before = _identity(path)
        contents = _load_once(path)
        if _identity(path) == before:
            return contents
    return contents


def _identity(path: Path) -> tuple[int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (-1, -1)
    return (stat.st_ino, stat.st_mtime_ns)


def _load_once(path: Path) -> LogContents:
    try:
        # locking=False: the file may be replaced while it is read, and a version 1 writer held its lock.
        with h5py.File(path, "r", locking=False) as handle:
            attrs = {key: _plain(value) for key, value in handle.attrs.items()}
            version = _check_version(attrs, path)
            snapshot = {name: handle[name][:] for name in TABLES}
    except LogError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise LogError(f"{path} is not a readable restage log ({first}); was it written by restage?") from None
    last = int(attrs.get("last_complete_step", -1))
    if version == 1:  # steps counted from 0: renumber as version 2 counts them
        last += 1
        for rows in snapshot.values():
            rows["step"] += 1
        attrs["resumed_at_steps"] = json.dumps([s + 1 for s in json.loads(attrs.get("resumed_at_steps", "[]"))])
        attrs["last_complete_step"] = last
    tables, dropped = {}, 0
    for name, rows in snapshot.items():
        keep = rows["step"] <= last  # version 1: rows of a step in flight when the writer died
        dropped += int((~keep).sum())
        tables[name] = rows[keep]
    try:
        records = journal.read(journal.journal_path(path), str(attrs.get("journal_id", "")))
    except OSError as err:
        raise LogError(f"{journal.journal_path(path)} is not readable ({err.strerror or err})") from None
    records = [r for r in records if int(r["step"]) > last]
    if records:
        for name, dtype_ in TABLES.items():
            added = np.array([tuple(row) for record in records for row in record[name]], dtype=dtype_)
            tables[name] = np.concatenate([tables[name].astype(dtype_), added])
        last = int(records[-1]["step"])
    return LogContents(attrs=attrs, tables=tables, last_complete_step=last, dropped_rows=dropped)


def _plain(value):
    """An HDF5 attribute as a plain Python value."""
    if isinstance(value, bytes):
        return value.decode()
    return value.item() if isinstance(value, np.generic) else value


def read_log(path: str | Path) -> RunLog:
    """Read a log, keeping only rows of completed steps. Safe on a log whose writer is still running or died;
    a damaged log is a one-line ``LogError``, never a raw ``OSError``."""
    path = resolve_log_path(path)
    contents = load_contents(path)
    attrs = contents.attrs
    try:
        return RunLog(
            path=path, format_version=int(attrs["format_version"]), world_size=int(attrs["world_size"]),
            dtype=str(attrs.get("dtype", "")), config=str(attrs.get("config", "")),
            schedule=_json_attr(attrs, "schedule"), cluster=_json_attr(attrs, "cluster"),
            versions=_json_attr(attrs, "versions") or {}, last_complete_step=contents.last_complete_step,
            closed=bool(attrs["closed"]), resumed_at_steps=json.loads(attrs.get("resumed_at_steps", "[]")),
            dropped_rows=contents.dropped_rows, **{name: _decoded(rows) for name, rows in contents.tables.items()})
    except (KeyError, ValueError) as err:
        raise LogError(f"{path} is not a readable restage log (attribute {err}); was it written by restage?") from None
