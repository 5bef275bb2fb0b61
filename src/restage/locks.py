"""Locks on files that several hosts may share (the trial directory, DeepSpeed's build directory).

A lock here must hold on any POSIX file system a cluster puts them on, and across its nodes. ``fcntl.flock``
does neither everywhere: Lustre mounted without ``flock`` and NFS without its lock manager raise ENOSYS, ENOLCK
or EOPNOTSUPP, and on some NFS set-ups an flock is only node-local, so two nodes both "hold" it. The one
primitive every shared file system gets right is exclusive creation, so each lock is a *lease*: a marker file
created with ``O_CREAT | O_EXCL`` that names its holder (pid, host, the process's start time) and whose
holder renews it from a background thread. A holder that died is found out: on this host at once (its pid is
gone, or now another process's), on another host once its marker has gone unrenewed for ``LEASE_SECONDS`` as
a waiter measures it on its own clock (no clocks are compared between hosts). flock is not used at all: where
it is node-local nobody can tell, so it could only ever add a second, weaker answer.

That is filelock's ``SoftFileLease`` (filelock >= 3.30; ``SoftFileLock`` alone, or filelock before it,
detects a dead holder only on its own host, so a node that crashed would hold the lock for ever). A waiter
wants more than who holds the marker: the lock's ``.holder`` file names the holder in restage's words
(``pid P on HOST ...``) for the messages, and keeps the last holder's name after it died, which the build
lock reports when it cleans up after it (``runtime/store/deepspeed_ops.py``).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from filelock import SoftFileLease, Timeout

from restage.disk import replace_atomically

# A holder renews its marker every LEASE_SECONDS / 3. Long enough that NFS attribute caching (at most 60 s by
# default) never shows a live holder's marker as unchanged for this long; every process must use the same value.
LEASE_SECONDS = 120.0


class HostLock:
    """An exclusive lock on ``folder/<name>.lease`` for every process on every host that sees ``folder``, with its
    holder's name in ``folder/<name>.holder``."""

    def __init__(self, folder: Path, name: str, lease_seconds: float = LEASE_SECONDS) -> None:
        self.lease_path = folder / f"{name}.lease"
        self.holder_path = folder / f"{name}.holder"
        self._lease = SoftFileLease(str(self.lease_path), lease_duration=lease_seconds, thread_local=False,
                                    is_singleton=False)

    def try_acquire(self) -> bool:
        """Take the lock if nobody alive holds it (breaking a dead holder's marker); False if it is held. The
        holder then names itself (``name_holder``)."""
        try:
            self._lease.acquire(blocking=False)
        except Timeout:
            return False
        return True

    def wait(self, seconds: float, poll_seconds: float = 1.0) -> bool:
        """``try_acquire``, retried for up to ``seconds`` (a holder on another host is known dead only once its
        lease has run out)."""
        try:
            self._lease.acquire(timeout=seconds, poll_interval=poll_seconds)
        except Timeout:
            return False
        return True

    def name_holder(self, note: str = "") -> None:
        """Write our name in the holder file (the lock's holder only)."""
        replace_atomically(self.holder_path, f"pid {os.getpid()} on {socket.gethostname()}{note}\n".encode(),
                           durable=False)

    def release(self) -> None:
        """Drop the lock; the holder file is emptied: a clean release leaves no name to blame."""
        replace_atomically(self.holder_path, b"", durable=False)
        self._lease.release()

    def holder(self) -> str:
        """Who holds (or last held) the lock, as its holder file says, or "a process that wrote no name"."""
        try:
            line = self.holder_path.read_text(errors="replace").strip()
        except OSError:
            line = ""
        return line or "a process that wrote no name"

    def held_here_by_a_live_process(self) -> bool:
        """Whether the holder file names a live process on this host (so waiting for its lease is pointless)."""
        words = self.holder().split()
        if len(words) < 4 or words[0] != "pid" or words[2] != "on" or not words[1].isdigit():
            return False
        if words[3] != socket.gethostname():
            return False
        try:
            os.kill(int(words[1]), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # another user's live process
        return True
