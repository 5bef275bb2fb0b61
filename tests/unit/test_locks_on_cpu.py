"""restage.locks.HostLock: one holder across hosts; a dead holder's lease broken at once on its host, after the
lease on another; never an flock."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

from restage.locks import HostLock

# A holder on another host ("node-a") with a one-second lease; it renews every third of a second.
HOLD = """
import socket, sys, time
from pathlib import Path
socket.gethostname = lambda: "node-a"
from restage.locks import HostLock
lock = HostLock(Path(sys.argv[1]), "x", lease_seconds=1.0)
assert lock.try_acquire()
lock.name_holder()
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "held\n"
    return process


def test_a_live_holder_on_another_host_keeps_its_lease_and_a_dead_one_loses_it_after_the_lease(tmp_path):
    holder = _holder(tmp_path)
    try:
        mine = HostLock(tmp_path, "x", lease_seconds=1.0)
        assert not mine.wait(3.0, poll_seconds=0.05)  # renewed meanwhile: never taken
        assert mine.holder() == f"pid {holder.pid} on node-a" and not mine.held_here_by_a_live_process()
    finally:
        holder.kill()
        holder.wait()
    fresh = HostLock(tmp_path, "x", lease_seconds=1.0)  # a waiter that first looks now
    started = time.monotonic()
    assert fresh.wait(10.0, poll_seconds=0.05)  # its pid means nothing here: known dead once unrenewed for 1 s
    assert 1.0 <= time.monotonic() - started < 5.0
    fresh.release()


def test_no_flock_is_taken(tmp_path, monkeypatch):
    def no_flock(*args):
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    first, second = HostLock(tmp_path, "x"), HostLock(tmp_path, "x")
    assert first.try_acquire() and not second.try_acquire()
    first.release()
    assert second.try_acquire()
    second.release()
