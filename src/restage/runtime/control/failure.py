"""Turning any rank's failure into a fast, named, whole-job exit.

A rank that raises writes its error to ``<trial>/failures/rank<N>.txt`` and aborts the MPI job,
so mpirun kills every other rank at once (no rank waits in a collective for a dead peer). A rank
killed outright (SIGKILL, OOM killer) is noticed by mpirun itself, which names it in its output.
The launcher turns either into one last line: ``rank N failed: <error>``.

The failure file may not get written (a full disk is a common reason to fail), so the rank also
prints ``[rank N] <error>`` to stderr, and the launcher reads that from mpirun's output when the
file is missing. A file is written whole or not at all (temporary file, rename): a half-written,
0-byte one never misleads the launcher. A user-caused error (``RestageError``, e.g. a full disk)
prints no traceback; the failure file keeps it.

A rank that stops making progress (stopped, stuck) is found by the launcher's watchdog
(``launch/watchdog.py``), which records its line as ``<trial>/failures/watchdog.txt`` before it ends
the job; that line is the cause, whatever the others then report.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from restage.disk import replace_atomically
from restage.errors import LogError, RestageError
from restage.report.log import read_log
from restage.runtime.checkpoint.checkpoint_dir import complete_steps
from restage.runtime.control.heartbeat import heartbeat_dir, read_beat


def failure_dir(trial_dir: str | Path) -> Path:
    return Path(trial_dir) / "failures"


@contextmanager
def abort_on_error(rank: int, trial_dir: str | Path) -> Iterator[None]:
    """Run the body; on any exception record it for the launcher and abort the whole MPI job."""
    try:
        yield
    except BaseException as err:  # SystemExit and KeyboardInterrupt must take the job down too
        if isinstance(err, SystemExit) and not err.code:
            raise
        summary = f"{type(err).__name__}: {err}".splitlines()[0] if str(err) else type(err).__name__
        if _COMMUNICATION.search(summary):
            # Most likely a peer died: give mpirun a moment to notice and name it (its report of a
            # killed rank is the root cause; this rank's closed connection is only the echo).
            time.sleep(3)
        try:
            _record(failure_dir(trial_dir) / f"rank{rank}.txt", summary + "\n" + traceback.format_exc())
        finally:
            print(f"[rank {rank}] {summary}", file=sys.stderr, flush=True)
            if not isinstance(err, RestageError):
                traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            _abort()


def _record(path: Path, text: str) -> None:
    """Write a failure file whole or not at all; on a full disk the stderr line is the record."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(path, text.encode())
    except OSError:
        pass


def _abort() -> None:
    try:
        # lazy: the launcher imports this module and is no MPI rank (importing mpi4py initialises MPI)
        from mpi4py import MPI

        if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
            MPI.COMM_WORLD.Abort(1)
    finally:
        os._exit(1)


_COMMUNICATION = re.compile(r"gloo|nccl|connection closed|connection reset|timed out|timeout|peer|pair closure|broken pipe",
                            re.I)
_MPIRUN_DEATH = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on\s+signal (\d+)", re.S)
_RANK_LINE = re.compile(r"^\[rank (\d+)\] (\S.*)$", re.M)
_DISK_FULL = "DiskFullError: "

WATCHDOG_FILE = "watchdog.txt"


def record_watchdog(trial_dir: str | Path, line: str) -> None:
    """The watchdog's reason for ending the job, kept for ``describe_failure``."""
    folder = failure_dir(trial_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WATCHDOG_FILE).write_text(line + "\n")


def describe_failure(trial_dir: str | Path, launcher_output: str = "") -> str:
    """One line naming the failed rank and its error, from the failure files or mpirun's output.

    The watchdog's line beats everything (it ended the job); then a full disk (every other error is
    then its consequence), which says what it kept.
    A rank's own error beats the errors its peers then hit in collectives (a dead peer shows up
    on the others as a closed connection or a timeout), and a rank killed by a signal beats both.
    """
    folder = failure_dir(trial_dir)
    watchdog = _first_line(folder / WATCHDOG_FILE)
    if watchdog:  # it ended the job: the ranks' errors and deaths follow from that
        return watchdog
    errors = _recorded_errors(folder)
    seen = {rank for rank, _ in errors}
    errors += [(rank, error) for rank, error in _RANK_LINE.findall(launcher_output) if rank not in seen]
    full = [(rank, error) for rank, error in errors if error.startswith(_DISK_FULL)]
    if full:
        rank, error = full[0]
        return f"{error.removeprefix(_DISK_FULL)} (rank {rank}); kept: {_kept(trial_dir)}"
    match = _MPIRUN_DEATH.search(" ".join(launcher_output.split()))
    if match and match.group(1) not in {rank for rank, _ in errors}:
        return f"rank {match.group(1)} died from signal {match.group(2)}"
    own = [e for e in errors if not _COMMUNICATION.search(e[1])]
    if own:
        rank, error = own[0]
        return f"rank {rank} failed: {error}"
    if errors:  # only the echo (a timeout, a closed connection): say where the peer it waited on was
        rank, error = errors[0]
        return f"rank {rank} failed: {error}" + _busiest_peer(trial_dir, int(rank))
    return "a rank exited abnormally without a recorded error (see the launcher output above)"


def _first_line(path: Path) -> str:
    """The first line of a failure file; "" when it is missing, empty or unreadable (e.g. a full disk)."""
    try:
        return next(iter(path.read_text(errors="replace").splitlines()), "").strip()
    except OSError:
        return ""


def _recorded_errors(folder: Path) -> list[tuple[str, str]]:
    """(rank, first line) of each failure file, oldest first; an empty or unreadable file is skipped."""
    found = []
    for path in folder.glob("rank*.txt") if folder.is_dir() else []:
        try:
            lines = path.read_text(errors="replace").splitlines()
            found.append((path.stat().st_mtime, path.stem.removeprefix("rank"), lines[0]))
        except (OSError, IndexError):
            continue
    return [(rank, line) for _, rank, line in sorted(found) if line.strip()]


def _kept(trial_dir: str | Path) -> str:
    """What a failed run leaves behind: its readable log steps and whole checkpoints."""
    try:
        last = read_log(trial_dir).last_complete_step
        log = f"log steps 1..{last}" if last >= 1 else "no log step"
    except LogError as err:
        log = f"no readable log ({err})"
    saved = complete_steps(trial_dir)
    checkpoints = f"checkpoints {', '.join(f'step-{s}' for s in saved)}" if saved else "no checkpoint"
    return f"{log}, {checkpoints}"


def _busiest_peer(trial_dir: str | Path, failed_rank: int) -> str:
    """"; rank R on H was last seen in <activity> (N s)" for the rank longest in a non-waiting activity, from the
    heartbeats: the one a collective that timed out most likely waited on ("" when none is known)."""
    folder = heartbeat_dir(trial_dir)
    beats = [read_beat(path) for path in folder.glob("rank*.json")] if folder.is_dir() else []
    busy = [b for b in beats if b is not None and b.rank != failed_rank and not b.waiting and not b.done]
    if not busy:
        return ""
    beat = max(busy, key=lambda b: b.activity_seconds)
    return f"; rank {beat.rank} on {beat.host} was last seen in {beat.activity} ({beat.activity_seconds:.0f} s)"


def clear_failures(trial_dir: str | Path) -> None:
    folder = failure_dir(trial_dir)
    if folder.is_dir():
        for path in [*folder.glob("rank*.txt"), folder / WATCHDOG_FILE]:
            path.unlink(missing_ok=True)
