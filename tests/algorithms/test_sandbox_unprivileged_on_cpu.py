"""The code sandbox run by an unprivileged user (``nobody``, via setpriv): the same hostile answers score 0 and harm
nothing, with its fences chosen at run time: a user namespace with its own network namespace where unprivileged
user namespaces work, Landlock, rlimits and the audit hook; and, with namespaces off (what a machine without user
namespaces gets), the documented weaker network fence, reported in one line. Attacks that go around the audit hook
(a shell started through ``_posixsubprocess``) are refused by the kernel fences."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from victim import snapshot

from restage.algorithms import sandbox

HELPER = Path(__file__).with_name("sandbox_as_user.py")
NOBODY = 65534
SECRET = "s3cret-token-4711"
ADD = "\ndef add(a, b):\n    return a + b"
TEST = "assert add(1, 2) == 3"


def python_for_nobody() -> str | None:
    return next((p for p in ("/usr/bin/python3", "/usr/local/bin/python3") if sandbox._everyone_can_run(p)), None)


def landlock_abi() -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return int(libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or python_for_nobody() is None,
                                reason="needs root (to become nobody), setpriv and a Python nobody can run")


def around_the_hook(shell: str) -> str:
    """Answer code that starts ``/bin/bash -c shell`` through ``_posixsubprocess`` (no audit event) and waits."""
    return ("import _posixsubprocess, os\nr, w = os.pipe()\n"
            f"pid = _posixsubprocess.fork_exec([b'/bin/bash', b'-c', {shell.encode()!r}], [b'/bin/bash'], True, (w,), "
            "None, None, -1, -1, -1, -1, -1, -1, r, w, False, False, -1, None, None, -1, -1, None, False)\n"
            "os.close(w)\nos.waitpid(pid, 0)" + ADD)


def processes_of(uid: int) -> int:
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            count += any(line.split()[1:2] == [str(uid)] for line in status.read_text().splitlines()
                         if line.startswith("Uid:"))
        except OSError:
            continue
    return count


def back_to(baseline: int, within_seconds: float) -> bool:
    """Whether nobody's process count returns to ``baseline`` within the time given."""
    end = time.monotonic() + within_seconds
    while processes_of(NOBODY) != baseline:
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def as_nobody(cases: list[dict]) -> tuple[list[dict], list[str]]:
    """Run the cases in the helper as nobody, with SECRET in its environment: (results, its stderr lines)."""
    run = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", python_for_nobody(),
                          str(HELPER), str(Path(sandbox.__file__))], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=300, cwd="/", env={"PATH": "/usr/bin:/bin", "RESTAGE_TEST_SECRET": SECRET})
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout)
    assert out["uid"] == NOBODY
    return out["results"], run.stderr.splitlines()


@pytest.mark.parametrize("namespaces", [True, False], ids=["user-namespace", "no-namespaces"])
def test_hostile_answers_score_0_and_harm_nothing_as_an_unprivileged_user(outside, listener, namespaces):
    port, accepted = listener
    kernel_fences = landlock_abi() >= 4  # files, other processes and (without a network namespace) TCP
    hostile = {
        "loop": "while True:\n    pass" + ADD,
        "fork bomb": "import os\nwhile True:\n    os.fork()" + ADD,
        "shell fork bomb": around_the_hook(":(){ :|:& };:"),
        "write outside": f"open({str(outside / 'new.txt')!r}, 'w').write('x')" + ADD,
        "append outside": f"open({str(outside / 'keep.txt')!r}, 'a').write('x')" + ADD,
        "delete outside": f"import os\nos.remove({str(outside / 'keep.txt')!r})" + ADD,
        "escape upwards": "open('../escape.txt', 'w').write('x')" + ADD,
        "our variables": f"import os\nassert os.environ.get('RESTAGE_TEST_SECRET') == {SECRET!r}" + ADD,
        "parent's environ": f"assert {SECRET!r} in open('/proc/{{parent}}/environ').read()" + ADD,
        "connect": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)" + ADD,
    }
    if kernel_fences:
        hostile |= {
            "shell writes outside": around_the_hook(f"echo x > {outside}/new.txt; echo x >> {outside}/keep.txt; "
                                                    f"test -f {outside}/new.txt") + "\nassert False",
            "shell reads the parent's environ": around_the_hook(f"grep -q {SECRET} /proc/$PPID/environ "
                                                                "/proc/{parent}/environ && touch leaked")
            + "\nimport os\nassert os.path.exists('leaked')",
            "shell connects": around_the_hook(f"echo hi > /dev/tcp/127.0.0.1/{port} && touch sent")
            + "\nimport os\nassert os.path.exists('sent')",
        }
    good = {"good": "def add(a, b):\n    return a + b", "scratch": "open('scratch.txt', 'w').write('7')" + ADD,
            "clean environment": "import os\nassert set(os.environ) <= {'PATH', 'HOME', 'LANG', 'LC_CTYPE'}" + ADD}
    cases = {**hostile, **good}
    before, baseline = snapshot(outside), processes_of(NOBODY)
    left = sorted(Path(tempfile.gettempdir()).glob("restage-sandbox-*"))
    results, stderr = as_nobody([{"code": code, "test": TEST, "timeout": 2.0, "namespaces": namespaces}
                                 for code in cases.values()])
    passed = {name: r["passed"] for name, r in zip(cases, results)}
    assert passed == {**{name: False for name in hostile}, **{name: True for name in good}}
    assert max(r["seconds"] for r in results) < 2.0 + 2.0  # the loop and the bombs are cut off at the time limit
    assert snapshot(outside) == before  # byte for byte, modes too
    assert back_to(baseline, within_seconds=5.0)  # no bomb's child left behind (SIGKILLed ones take a moment to go)
    assert accepted == []
    assert sorted(Path(tempfile.gettempdir()).glob("restage-sandbox-*")) == left
    weaker = [line for line in stderr if line.startswith("restage: sandbox: weaker isolation")]
    if namespaces:
        assert weaker == []  # a user namespace, its network namespace and Landlock held (this machine has them)
    else:  # the documented weaker fence, said once for the whole run
        assert len(weaker) == 1 and "no network namespace" in weaker[0]
        assert ("TCP is refused by Landlock" in weaker[0]) == kernel_fences
