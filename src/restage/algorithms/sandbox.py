"""Running an untrusted answer's Python code against one test, in a confined subprocess.

``run_test(code, test, limits)`` is True when the answer's code and then the test run to the end in
the sandbox. Each run gets:

* a throwaway working directory (created here, removed after), its only writable place;
* an environment of ``PATH``, ``HOME`` (the working directory) and ``LANG`` alone: nothing of ours;
* resource limits: address space, CPU seconds, processes, file size, open files; a wall-clock limit
  after which its whole process group is killed;
* as root (this machine): a new network namespace with no interfaces (``unshare(CLONE_NEWNET)``) and
  the uid ``nobody``, so the kernel refuses every write to our files; without root the audit hook
  below is the only fence (documented in docs/algorithms.md, "Verifiable rewards");
* an audit hook (``sandbox_child.py``) refusing writes outside the working directory, new processes,
  signals, sockets, ``ctypes``, reads of other processes' ``/proc`` and of our home directory.

The sandbox protects the machine; it does not promise an answer cannot game its score.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CHILD = Path(__file__).with_name("sandbox_child.py")
NOBODY = 65534


@dataclass(frozen=True)
class Limits:
    timeout_seconds: float = 5.0
    memory_bytes: int = 512 * 2**20
    processes: int = 16
    file_bytes: int = 16 * 2**20


def _everyone_can_run(path: str) -> bool:
    """Whether ``nobody`` can execute ``path`` (every parent directory searchable, the file executable by others)."""
    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & stat.S_IXOTH:
            return False
        return all(parent.stat().st_mode & stat.S_IXOTH for parent in real.parents)
    except OSError:
        return False


def sandbox_python() -> str:
    """An interpreter the sandbox can run: ours, or as root one that ``nobody`` can still execute."""
    if os.geteuid() != 0 or _everyone_can_run(sys.executable):
        return sys.executable
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if candidate and _everyone_can_run(candidate):
            return candidate
    return sys.executable  # the child drops its uid after start-up, once the interpreter is loaded


def run_test(code: str, test: str, limits: Limits = Limits()) -> bool:
    """True when ``code`` then ``test`` run to the end in the sandbox within ``limits``."""
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="restage-sandbox-")
    try:
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        request = {"code": code, "test": test, "nonce": nonce,
                   "forbidden_reads": sorted({os.path.expanduser("~"), "/root"}),
                   "limits": {"memory_bytes": limits.memory_bytes, "processes": limits.processes,
                              "file_bytes": limits.file_bytes, "cpu_seconds": max(1, int(limits.timeout_seconds) + 1)}}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
        process = subprocess.Popen([sandbox_python(), "-I", "-B", str(CHILD)], cwd=workdir, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True, close_fds=True)
        try:
            out, _ = process.communicate(json.dumps(request).encode(), timeout=limits.timeout_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return False
        finally:
            _kill_group(process)  # anything it left behind in its session
        return process.returncode == 0 and out.decode(errors="replace").rstrip().endswith(nonce)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
