"""Each rank's heartbeat: a daemon thread that says, every few seconds, that the rank lives and what it is doing.

The rank's main thread names its current activity (``doing``: a start-up phase, a step's op, a control-plane
wait) and marks the start-up phases it has passed (``reached``); the thread writes both, with a beat counter,
to ``<trial>/heartbeats/rank<R>.json``: every ``interval_seconds``, and soon after each change of activity
(at most every ``MIN_WRITE_SECONDS``), so the file names what the rank was doing when it stopped. The
launcher's watchdog (``launch/watchdog.py``), outside MPI and so never blocked by a stalled rank, reads
these files: a rank whose beat stops (SIGSTOP stops every thread of
the process) or whose peers wait on it past their timeout ends the job, named with its host and activity.

The record is the contract between the two sides; neither imports the other's code.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from restage.disk import replace_atomically

# Start-up phases in order; the watchdog prints one line when every rank has passed each.
MIN_WRITE_SECONDS = 0.2  # at most five writes a second, however fast the ops go by
STARTUP_PHASES = ("ranks up", "compiled ops ready", "process groups made", "models loaded", "engines built", "ready")


@dataclass(frozen=True)
class Beat:
    """One heartbeat record, as written by a rank and read by the watchdog."""

    rank: int
    host: str
    pid: int
    beat: int  # counts the thread's writes: it stops when the process is stopped or frozen
    activity: str  # e.g. "step 3: run actor_train", "start-up: waiting for every rank to join torch.distributed"
    waiting: bool  # waiting for other ranks (or another process), not computing
    startup: bool  # still starting up (bounded by run.startup_timeout_seconds)
    activity_seconds: float  # in this activity so far, on the rank's own monotonic clock
    phase: int  # start-up phases passed (an index into STARTUP_PHASES, -1 before the first)
    done: bool = False  # finished or failing: the rank exits next


def beat_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"rank{rank}.json"


def heartbeat_dir(trial_dir: str | Path) -> Path:
    return Path(trial_dir) / "heartbeats"


def read_beat(path: Path) -> Beat | None:
    """The record at ``path``, or None if there is none (yet) or it cannot be read."""
    try:
        return Beat(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def beat_interval_seconds(timeout_seconds: float) -> float:
    """Often enough that a silent rank is noticed within a tenth of the timeout; at most every 5 s (shared file
    systems), at least every 0.5 s."""
    return min(5.0, max(0.5, timeout_seconds / 10))


class Heartbeat:
    """This rank's heartbeat thread and the activity the main thread reports to it."""

    def __init__(self, folder: Path, rank: int, interval_seconds: float = 1.0):
        self.path = beat_path(folder, rank)
        self.rank, self.host, self.pid = rank, socket.gethostname(), os.getpid()
        self.interval_seconds = interval_seconds
        self._beat = 0
        self._phase = -1
        self.started_at = time.monotonic()
        # One tuple, replaced whole (atomic under the GIL): (activity, waiting, startup, done, since).
        self._now = ("start-up: starting", False, True, False, time.monotonic())
        self._stopped = threading.Event()
        self._changed = threading.Event()
        self._writing = threading.Lock()  # the main thread writes too (reached, finish)
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._loop, name="restage-heartbeat", daemon=True)
        self._thread.start()
        return self

    def doing(self, activity: str, *, waiting: bool = False) -> None:
        """The main thread's current activity (kept while starting up until ``reached("ready")``)."""
        startup = self._phase < len(STARTUP_PHASES) - 1
        self._now = (activity, waiting, startup, False, time.monotonic())
        self._changed.set()

    def reached(self, phase: str) -> None:
        """Start-up has passed ``phase`` (one of STARTUP_PHASES) on this rank; written at once."""
        self._phase = STARTUP_PHASES.index(phase)
        activity, waiting, _, _, since = self._now
        self._now = (activity, waiting, self._phase < len(STARTUP_PHASES) - 1, False, since)
        self._write()

    def finish(self, activity: str = "exiting") -> None:
        """The rank is ending (done or failing): the watchdog stops expecting beats from it."""
        self._now = (activity, False, False, True, time.monotonic())
        self._stopped.set()
        self._changed.set()
        self._write()

    def snapshot(self) -> Beat:
        activity, waiting, startup, done, since = self._now
        return Beat(self.rank, self.host, self.pid, self._beat, activity, waiting, startup,
                    round(time.monotonic() - since, 3), self._phase, done)

    def _write(self) -> None:
        with self._writing:
            self._beat += 1
            try:  # not fsynced: a beat matters only while the machine is up
                replace_atomically(self.path, json.dumps(asdict(self.snapshot())).encode(), durable=False)
            except OSError:
                pass  # a full or vanished trial directory must not kill the rank; the watchdog sees silence

    def _loop(self) -> None:
        while True:
            self._changed.wait(self.interval_seconds)
            self._changed.clear()
            if self._stopped.is_set():
                return
            self._write()
            time.sleep(MIN_WRITE_SECONDS)
