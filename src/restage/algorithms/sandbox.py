"""Running an untrusted answer's Python code against one test, in a confined subprocess.

``run_test(code, test, limits)`` is True when the answer's code and then the test run to the end in
the sandbox; ``run_program`` runs the same way and also returns what it printed (a tool call's output,
``algorithms/tools.py``). Each run gets:

* a throwaway working directory (created here, removed after), its only writable place;
* an environment of ``PATH``, ``HOME`` (the working directory) and ``LANG`` alone: nothing of ours;
* resource limits: address space, CPU seconds, processes, file size, open files; a wall-clock limit
  after which its whole process group is killed;
* fences chosen at run time by what the kernel allows (``sandbox_child.confine``): no network (as root
  a new network namespace and the uid ``nobody``; without root a new user namespace with its own
  network namespace), Landlock (writes only in the working directory, reads only of the interpreter's
  libraries and system directories, no access to other processes; TCP refused where no network
  namespace was had);
* an audit hook (``sandbox_child.py``) refusing writes outside the working directory, new processes,
  signals, sockets, ``ctypes``, reads of other processes' ``/proc`` and of our home directory.

Where a kernel fence is missing (no user namespaces, no Landlock) the audit hook is what is left; the
first run that finds so says which, in one line on stderr (docs/algorithms.md, "Verifiable rewards").
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
SYSTEM_READS = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc", "/dev", "/proc")
_said: set[str] = set()  # the weaker-fence lines already printed by this process


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


def read_roots(python: str) -> list[str]:
    """What the sandbox may read besides its working directory: system directories and the interpreter's own."""
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, str(Path(python).parent.parent)}
    return sorted({*SYSTEM_READS, *(os.path.realpath(p) for p in prefixes), *prefixes})


def weaker_fences(network: str, files: str) -> str | None:
    """The one line saying which kernel fences a sandbox run lacked (None when it had them all)."""
    lacking = []
    if network != "namespace":
        lacking.append("no network namespace (user namespaces are off here, or refused): "
                       + ("TCP is refused by Landlock, other sockets" if network == "landlock-tcp" else "sockets")
                       + " only by the audit hook")
    if files == "hook":
        lacking.append("no Landlock and no uid change: writes outside its directory and reads of our files are "
                       "refused only by the audit hook")
    if not lacking:
        return None
    return "restage: sandbox: weaker isolation on this machine: " + "; ".join(lacking)


def run_test(code: str, test: str, limits: Limits = Limits(), namespaces: bool = True) -> bool:
    """True when ``code`` then ``test`` run to the end in the sandbox within ``limits``; ``namespaces=False``
    skips the namespace fences (what a machine without user namespaces gets; for tests)."""
    return run_program(code, test, limits, namespaces).finished


@dataclass(frozen=True)
class ProgramRun:
    """What a sandboxed run left: whether it ran to the end, whether the wall-clock limit stopped it, its stdout
    (the nonce line removed, cut to the first ``max_output_chars``) and its stderr's last line (an error)."""

    finished: bool
    timed_out: bool
    stdout: str
    error: str


def run_program(code: str, test: str = "", limits: Limits = Limits(), namespaces: bool = True,
                max_output_chars: int = 4096) -> ProgramRun:
    """Run ``code`` then ``test`` in the sandbox within ``limits`` (``run_test``'s fences); returns its output too
    (a tool's observation, ``algorithms/tools.py``)."""
    nonce = secrets.token_hex(16)
    workdir = tempfile.mkdtemp(prefix="restage-sandbox-")
    try:
        if os.geteuid() == 0:
            os.chown(workdir, NOBODY, NOBODY)
        python = sandbox_python()
        request = {"code": code, "test": test, "nonce": nonce, "namespaces": namespaces,
                   "forbidden_reads": sorted({os.path.expanduser("~"), "/root"}), "read_roots": read_roots(python),
                   "limits": {"memory_bytes": limits.memory_bytes, "processes": limits.processes,
                              "file_bytes": limits.file_bytes, "cpu_seconds": max(1, int(limits.timeout_seconds) + 1)}}
        env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
        process = subprocess.Popen([python, "-I", "-B", str(CHILD)], cwd=workdir, env=env,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True, close_fds=True)
        try:
            out, err = process.communicate(json.dumps(request).encode(), timeout=limits.timeout_seconds)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return ProgramRun(False, True, "", f"timed out after {limits.timeout_seconds:g} s")
        finally:
            _kill_group(process)  # anything it left behind in its session
        text = out.decode(errors="replace")
        finished = process.returncode == 0 and _passed(text, nonce)
        body = text.rstrip().rpartition("\n")[0] if finished else text
        error = err.decode(errors="replace").strip().rpartition("\n")[2]
        return ProgramRun(finished, False, body.strip("\n")[:max_output_chars], "" if finished else error)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _passed(out: str, nonce: str) -> bool:
    """Whether the child's last line is the nonce (and the fences that held, reported once if weaker)."""
    last = out.rstrip().rpartition("\n")[2].split()
    if not last or last[0] != nonce:
        return False
    fences = dict(part.partition("=")[::2] for part in last[1:])
    line = weaker_fences(fences.get("network", "hook"), fences.get("files", "hook"))
    if line is not None and line not in _said:
        _said.add(line)
        print(line, file=sys.stderr, flush=True)
    return True


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
