"""The code reward's sandbox: hostile answers score 0 and change nothing outside their throwaway directory."""

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from victim import snapshot

from restage.algorithms import rewards
from restage.algorithms.sandbox import Limits, run_test
from restage.config.sections import RewardsConfig

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
OPTIONS = RewardsConfig(code_timeout_seconds=3.0)


@pytest.fixture(autouse=True)
def private_tempdir(monkeypatch):
    """The sandboxes of these tests go under a temp dir of their own, so another process's sandboxes (a suite or a
    run beside this one) never show up in ``sandboxes_left``; traversable, as /tmp is, for the sandbox's own uid."""
    root = Path(tempfile.mkdtemp(prefix="restage-sbtest-"))
    os.chmod(root, 0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    monkeypatch.undo()
    shutil.rmtree(root, ignore_errors=True)


def sandboxes_left() -> list[str]:
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob("restage-sandbox-*"))


def score(completion: str, tests=TESTS) -> float:
    return rewards.resolve_reward("code", OPTIONS)("write add", completion, tests=tests)


def test_the_fraction_of_tests_passed():
    assert score("```python\ndef add(a, b):\n    return a + b\n```") == 1.0
    assert score("def add(a, b):\n    return a + b if a >= 0 else 5") == pytest.approx(2 / 3)
    assert score("def add(a, b):\n    return 1") == 0.0
    assert score("def add(a, b): return a + b", tests='["assert add(1, 1) == 2"]') == 1.0  # JSON list, as parquet holds


def test_an_infinite_loop_scores_0_within_the_time_limit(outside):
    before, left = snapshot(outside), sandboxes_left()
    began = time.perf_counter()
    quick = rewards.resolve_reward("code", RewardsConfig(code_timeout_seconds=1.0))
    assert quick("write add", "def add(a, b):\n    while True:\n        pass\nadd(1, 1)", tests=TESTS) == 0.0
    assert time.perf_counter() - began < 3 * (1.0 + 1.5)  # three tests, each cut off after 1 s
    assert snapshot(outside) == before and sandboxes_left() == left


def test_a_fork_bomb_scores_0_and_leaves_no_process(outside):
    psutil = pytest.importorskip("psutil")
    before, left = snapshot(outside), sandboxes_left()
    bomb = "import os\nwhile True:\n    os.fork()\ndef add(a, b):\n    return a + b"
    assert score(bomb) == 0.0
    assert run_test("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\ndef add(a, b): return a + b",
                    TESTS[0], Limits(timeout_seconds=3.0)) is False
    assert [p.pid for p in psutil.process_iter(["cmdline"]) if "sandbox_child.py" in " ".join(p.info["cmdline"] or [])] \
        == []
    assert snapshot(outside) == before and sandboxes_left() == left


def test_writes_outside_score_0_and_change_nothing(outside):
    before, left = snapshot(outside), sandboxes_left()
    for attack in (f"open({str(outside / 'new.txt')!r}, 'w').write('x')",
                   f"open({str(outside / 'keep.txt')!r}, 'a').write('x')",
                   f"import os\nos.remove({str(outside / 'keep.txt')!r})",
                   f"import os\nos.rename({str(outside / 'keep.txt')!r}, 'stolen.txt')",
                   f"import shutil\nshutil.rmtree({str(outside)!r})",
                   f"import os\nos.chmod({str(outside / 'keep.txt')!r}, 0o777)",
                   "open('../escape.txt', 'w').write('x')"):
        assert score(attack + "\ndef add(a, b):\n    return a + b") == 0.0, attack
    assert snapshot(outside) == before and sandboxes_left() == left
    # ... while its own working directory is writable
    assert score("open('scratch.txt', 'w').write('7')\ndef add(a, b):\n    return a + b") == 1.0


def test_reading_the_environment_scores_0(outside, monkeypatch):
    monkeypatch.setenv("RESTAGE_TEST_SECRET", "s3cret-token")
    before = snapshot(outside)
    leak = "import os\ndef add(a, b):\n    return a + b"
    assert score(leak, tests=["assert os.environ.get('RESTAGE_TEST_SECRET') == 's3cret-token'"]) == 0.0
    assert score(leak, tests=["assert set(os.environ) <= {'PATH', 'HOME', 'LANG', 'LC_CTYPE'}"]) == 1.0
    parent = f"/proc/{os.getpid()}/environ"
    assert score(leak, tests=[f"assert b's3cret-token' in open({parent!r}, 'rb').read()"]) == 0.0
    home = os.path.expanduser("~")
    assert score(leak, tests=[f"import os\nassert os.listdir({home!r}) is not None\n"
                              f"open(os.path.join({home!r}, '.bashrc')).read()"]) == 0.0
    assert snapshot(outside) == before


def test_no_network(listener):
    port, got = listener
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n" \
           "def add(a, b):\n    return a + b"
    assert score(code) == 0.0
    assert got == []
