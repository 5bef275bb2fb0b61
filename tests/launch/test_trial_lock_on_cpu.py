"""One run per trial: the trial lock refuses a second holder in one line naming the first, and ends with its holder."""

import os
import signal
import subprocess
import sys
import time

import pytest

from restage.errors import LaunchError
from restage.launch.trial import trial_lock

HOLD = """
import sys, time
from pathlib import Path
from restage.launch.trial import trial_lock
with trial_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(root):
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(root)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    root = tmp_path / "exp" / "trial"
    first = _holder(root)
    try:
        with pytest.raises(LaunchError) as refused:
            with trial_lock(root):
                pass
        message = str(refused.value)
        assert message.startswith(f"{root} is in use by pid {first.pid} on ") and "\n" not in message
        assert message.endswith("wait for that run to end or choose another trial=NAME")
    finally:
        first.terminate()
        first.wait()
    with trial_lock(root):  # released with its holder
        assert (root / ".holder").read_text().startswith(f"pid {os.getpid()} on ")


def test_the_lock_dies_with_a_killed_holder(tmp_path):
    root = tmp_path / "trial"
    first = _holder(root)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    started = time.monotonic()
    with trial_lock(root):
        assert time.monotonic() - started < 1.0


def test_a_file_system_without_flock_still_takes_the_trial_lock(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(*args):  # Lustre without flock: ENOSYS crashed the run before it started
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    root = tmp_path / "trial"
    with trial_lock(root):
        assert (root / ".holder").read_text().startswith(f"pid {os.getpid()} on ")
        with pytest.raises(LaunchError, match=f"is in use by pid {os.getpid()} on "):
            with trial_lock(root):
                pass
