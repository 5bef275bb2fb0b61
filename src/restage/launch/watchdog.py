"""The launcher's watchdog: ends a job whose ranks stop making progress, naming the rank, its host and activity.

It runs in the launcher (``restage run``, the SLURM job driver), outside MPI, so no stalled rank can block it,
and reads the ranks' heartbeat files (``runtime/control/heartbeat.py``) about once a second. Three cases end the job:

* **silent**: a rank's beat has not advanced for half of ``run.collective_timeout_seconds`` (its process is
  stopped, e.g. SIGSTOP, which stops the heartbeat thread too, or frozen); half, so that the job ends on this
  line before a peer's collective times out on the silent rank and reports only a timeout; a rank whose
  process is gone is left to mpirun, which names it;
* **overdue**: a rank has waited for others (or another process) longer than its bound,
  ``run.startup_timeout_seconds`` while starting up, else ``run.peer_wait_timeout_seconds``, or has spent
  longer than ``run.startup_timeout_seconds`` in one start-up activity; the rank named is the one the others
  wait on (the longest in a non-waiting activity), or, when every rank waits, the longest waiter;
* **missing**: a rank wrote no heartbeat within ``run.startup_timeout_seconds`` of the launch.

One case only warns: a rank that has spent longer than ``run.activity_timeout_seconds`` in one activity of a step
(an MFC, a transfer; not a wait, not start-up) gets one line, once per activity, even when no peer waits on it (a
reward that never returns, on a one-rank run or in async generation). It warns and does not stop: from outside, a
slow step (a long generation of a large model) looks the same as a hung one; the reward's own limit
(``rewards.timeout_seconds``) is what stops a hung reward.

It also prints one line each time every rank has passed a start-up phase (rank 0 says the last, "ready",
itself: the watchdog looks once a second, and a small job is past it by then), and while start-up is slow,
which rank is furthest behind and what it is doing.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from restage.runtime.control.failure import record_watchdog
from restage.runtime.control.heartbeat import STARTUP_PHASES, Beat, beat_path, heartbeat_dir, read_beat

NOTICE_SECONDS = 30.0  # while starting up, say who is furthest behind at most this often


@dataclass(frozen=True)
class Limits:
    """The run's timeouts, as the watchdog applies them."""

    startup_seconds: float
    collective_seconds: float
    wait_seconds: float
    activity_seconds: float = 0.0  # one step activity longer than this is warned of; 0: never

    @classmethod
    def from_run(cls, run) -> Limits:
        """From a ``RunConfig``."""
        return cls(run.startup_timeout_seconds, run.collective_timeout_seconds, run.peer_wait_timeout_seconds,
                   run.activity_timeout_seconds)

    @property
    def silent_seconds(self) -> float:
        """How long a rank may go without a heartbeat: before its peers' data-plane ops on it time out."""
        return self.collective_seconds / 2


def process_state(beat: Beat) -> str:
    """The rank's process state letter from /proc when it runs on this host ("T": stopped), "gone" if it has
    exited, "" when it cannot be seen from here."""
    if beat.host != socket.gethostname():
        return ""
    try:
        stat = Path(f"/proc/{beat.pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


class Watchdog:
    """Reads the heartbeats of ``world_size`` ranks under ``trial_dir``; ``check`` says why the job must end."""

    def __init__(self, trial_dir: str | Path, world_size: int, limits: Limits, *,
                 clock: Callable[[], float] = time.monotonic, say: Callable[[str], None] = print,
                 state: Callable[[Beat], str] = process_state):
        self.folder = heartbeat_dir(trial_dir)
        self.world_size, self.limits = world_size, limits
        self.clock, self.say, self.state = clock, say, state
        self.started = clock()
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (its last beat, when that beat was first seen)
        self.phases_said = -1
        self.all_running = False
        self.stalled: Beat | None = None  # the rank a failure line names
        self.last_notice = self.started
        self.warned: dict[int, tuple[str, float]] = {}  # rank -> (the activity warned of, its seconds then)

    def read(self) -> dict[int, Beat]:
        now = self.clock()
        beats = {}
        for rank in range(self.world_size):
            beat = read_beat(beat_path(self.folder, rank))
            if beat is None:
                continue
            beats[rank] = beat
            if self.seen.get(rank, (None,))[0] != beat.beat:
                self.seen[rank] = (beat.beat, now)
        return beats

    def check(self) -> str | None:
        """One look at every heartbeat: the one line that ends the job, or None while it is well."""
        beats = self.read()
        now = self.clock()
        self._say_progress(beats, now)
        self._warn_long(beats, now)
        return self._silent(beats, now) or self._overdue(beats, now) or self._missing(beats, now)

    def _warn_long(self, beats: dict[int, Beat], now: float) -> None:
        """One line for the ranks that passed ``run.activity_timeout_seconds`` in a step activity since the last
        look (each activity warned of once): the longest named in full, the others by number."""
        bound = self.limits.activity_seconds
        if bound <= 0:
            return
        over = {}
        for rank, beat in beats.items():
            if beat.done or beat.waiting or beat.startup:
                continue
            seconds = self._elapsed(rank, beat, now)
            earlier = self.warned.get(rank)
            if seconds > bound and not (earlier and earlier[0] == beat.activity and seconds >= earlier[1]):
                over[rank] = seconds
        if not over:
            return
        for rank, seconds in over.items():
            self.warned[rank] = (beats[rank].activity, seconds)
        rank = max(over, key=lambda r: over[r])
        beat = beats[rank]
        others = sorted(set(over) - {rank})
        also = f" (so have rank(s) {', '.join(map(str, others))})" if others else ""
        self.say(f"restage: watchdog: rank {rank} on {beat.host} (pid {beat.pid}) has spent {over[rank]:.0f} s in "
                 f"{beat.activity}, over run.activity_timeout_seconds={bound:g}{also}; still running (a reward that "
                 "never returns? rewards.timeout_seconds bounds one)")

    def _elapsed(self, rank: int, beat: Beat, now: float) -> float:
        """Seconds in the current activity, counting the time since the beat was written."""
        return beat.activity_seconds + (now - self.seen[rank][1])

    def _silent(self, beats: dict[int, Beat], now: float) -> str | None:
        for rank, beat in sorted(beats.items()):
            quiet_seconds = now - self.seen[rank][1]
            if beat.done or quiet_seconds <= self.limits.silent_seconds:
                continue
            state = self.state(beat)
            if state == "gone":
                continue  # exited or killed: mpirun names it
            what = "is stopped (SIGSTOP or a debugger)" if state in ("T", "t") else "stopped responding"
            self.stalled = beat
            return (f"rank {rank} on {beat.host} (pid {beat.pid}) {what}: no heartbeat for {quiet_seconds:.0f} s "
                    f"(half of run.collective_timeout_seconds={self.limits.collective_seconds:g}); it was last seen in "
                    f"{beat.activity}")
        return None

    def _bound(self, beat: Beat) -> tuple[str, float]:
        if beat.startup:
            return "run.startup_timeout_seconds", self.limits.startup_seconds
        return "run.peer_wait_timeout_seconds", self.limits.wait_seconds

    def _overdue(self, beats: dict[int, Beat], now: float) -> str | None:
        live = {r: b for r, b in beats.items() if not b.done}
        elapsed = {r: self._elapsed(r, b, now) for r, b in live.items()}
        overdue = [r for r, b in live.items() if (b.waiting or b.startup) and elapsed[r] > self._bound(b)[1]]
        if not overdue:
            return None
        working = [r for r, b in live.items() if not b.waiting]
        if working:
            culprit = max(working, key=lambda r: elapsed[r])
            beat = self.stalled = live[culprit]
            if culprit in overdue:  # a start-up activity that never ends (a build that hangs, a load)
                key, limit = self._bound(beat)
                return (f"rank {culprit} on {beat.host} (pid {beat.pid}) exceeded {key}={limit:g}: "
                        f"{elapsed[culprit]:.0f} s in {beat.activity}")
            waiter = max(overdue, key=lambda r: elapsed[r])
            key, limit = self._bound(live[waiter])
            waiters = ", ".join(str(r) for r in sorted(overdue))
            return (f"rank {culprit} on {beat.host} (pid {beat.pid}) was still in {beat.activity} after "
                    f"{elapsed[culprit]:.0f} s while rank(s) {waiters} waited for it beyond {key}={limit:g} "
                    f"(rank {waiter}: {live[waiter].activity})")
        waiter = max(overdue, key=lambda r: elapsed[r])
        beat = self.stalled = live[waiter]
        key, limit = self._bound(beat)
        others = "; ".join(f"rank {r}: {b.activity}" for r, b in sorted(live.items()) if r != waiter)
        return (f"rank {waiter} on {beat.host} (pid {beat.pid}) waited beyond {key}={limit:g} "
                f"({elapsed[waiter]:.0f} s) in {beat.activity}; every rank was waiting" + (f" ({others})" if others else ""))

    def _missing(self, beats: dict[int, Beat], now: float) -> str | None:
        if len(beats) == self.world_size or now - self.started <= self.limits.startup_seconds:
            return None
        missing = [r for r in range(self.world_size) if r not in beats]
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        return (f"rank(s) {shown} never started: no heartbeat within run.startup_timeout_seconds="
                f"{self.limits.startup_seconds:g} of the launch")

    def _say_progress(self, beats: dict[int, Beat], now: float) -> None:
        """A line as every rank passes each start-up phase; while start-up is slow, who is furthest behind."""
        last = len(STARTUP_PHASES) - 1
        if self.phases_said >= last:
            return
        seconds = now - self.started
        if not self.all_running and len(beats) == self.world_size:
            self.all_running = True
            self.last_notice = now
            self.say(f"restage: start-up: all {self.world_size} ranks running ({seconds:.1f} s)")
        phase = min((b.phase for b in beats.values()), default=-1) if len(beats) == self.world_size else -1
        if phase == last:  # the ranks are running steps: rank 0 has said "ready"
            self.phases_said = last
            return
        for index in range(self.phases_said + 1, phase + 1):
            self.say(f"restage: start-up: {STARTUP_PHASES[index]} on all {self.world_size} ranks ({seconds:.1f} s)")
            self.phases_said = index
            self.last_notice = now
        if now - self.last_notice >= NOTICE_SECONDS:
            self.last_notice = now
            behind = [r for r in range(self.world_size) if r not in beats or beats[r].phase == phase]
            first = beats.get(behind[0]) if behind else None
            doing = first.activity if first else "not started"
            self.say(f"restage: start-up: {seconds:.0f} s; {len(behind)} of {self.world_size} rank(s) still before "
                     f"'{STARTUP_PHASES[phase + 1]}' (rank {behind[0]}: {doing})")

    def watch(self, on_failure: Callable[[str], None], stop: threading.Event,
              poll_seconds: float = 1.0) -> threading.Thread:
        """Check every ``poll_seconds`` in a daemon thread until ``stop`` is set; call ``on_failure`` once."""

        def loop() -> None:
            while not stop.wait(poll_seconds):
                line = self.check()
                if line:
                    on_failure(line)
                    return

        thread = threading.Thread(target=loop, name="restage-watchdog", daemon=True)
        thread.start()
        return thread


def clear_heartbeats(trial_dir: str | Path) -> None:
    """Remove an earlier run's heartbeats, before the ranks start."""
    folder = heartbeat_dir(trial_dir)
    if folder.is_dir():
        for path in folder.glob("rank*.*"):
            path.unlink(missing_ok=True)


def guard(trial_dir: str | Path, world_size: int, limits: Limits, end_job: Callable[[], None],
          say: Callable[[str], None] = print) -> threading.Event:
    """Watch a job just launched; when it stalls, record why (``failures/watchdog.txt``), say it and call
    ``end_job``. Returns the event to set once the job has ended."""
    dog = Watchdog(trial_dir, world_size, limits, say=say)

    def fail(line: str) -> None:
        record_watchdog(trial_dir, line)
        say(f"restage: watchdog: {line}; ending the job")
        if dog.stalled is not None and process_state(dog.stalled) not in ("", "gone"):
            # Killed first where we can: mpirun's teardown sends a stopped rank SIGCONT before SIGTERM, and it
            # would run on for a moment (a step, a checkpoint) after the job was declared dead.
            _kill(dog.stalled.pid)
        end_job()

    stop = threading.Event()
    dog.watch(fail, stop)
    return stop


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def end_session(leader_pid: int, grace_seconds: float = 10.0) -> None:
    """SIGTERM to a launcher's process group (mpirun and every rank it started), SIGKILL after ``grace_seconds``
    (a stopped rank does not act on SIGTERM)."""

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(leader_pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_seconds
        while time.monotonic() < deadline:
            try:
                os.killpg(leader_pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)
