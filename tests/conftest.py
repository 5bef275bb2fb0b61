"""Suite-wide setup: every rank a test starts checks NCCL's rules (restage.testing.nccl_rules).

``runtime.control.spawn`` turns the layer on for its children itself; this covers ranks started through
mpirun (``restage run``, ``restage generate``, the e2e jobs), which inherit the environment.
Also the ``small_tmpfs`` fixture, for tests that fill a disk, and ``bench_module``, for tests of the benchmarks.
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("RESTAGE_NCCL_RULES", "1")
BENCH = Path(__file__).resolve().parents[1] / "bench"


def pytest_addoption(parser):
    parser.addoption("--scale", action="store_true",
                     help="also run the tests marked scale (make test-scale: the 8/16-rank matrix, the fuzzer, long cases)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``scale`` run only with ``--scale`` (``make test-scale``); deselected, not skipped, otherwise."""
    if config.getoption("--scale"):
        return
    kept, dropped = [], []
    for item in items:
        (dropped if item.get_closest_marker("scale") else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture(scope="session")
def bench_module():
    """``bench_module(name)``: the script ``bench/<name>.py`` imported as a module (bench/ is not a package)."""

    def load(name: str):
        sys.path.insert(0, str(BENCH))
        try:
            return importlib.import_module(name)
        finally:
            sys.path.remove(str(BENCH))

    return load


@pytest.fixture
def small_tmpfs(tmp_path):
    """``mount(size_bytes, name)``: a fresh tmpfs of that size under ``tmp_path`` (root only), unmounted at teardown."""
    mounted: list[Path] = []

    def mount(size_bytes: int, name: str = "tmpfs") -> Path:
        if os.geteuid() != 0:
            pytest.skip("mounting a small tmpfs needs root")
        point = tmp_path / name
        point.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(point)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"mount -t tmpfs failed here: {done.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "--lazy", str(point)], check=False)
