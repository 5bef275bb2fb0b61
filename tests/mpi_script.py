"""Run a test's helper script on real mpirun ranks (gloo/MPI on CPU), with the tests' folder and src on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from restage.launch.mpirun import mpirun_command

TESTS = Path(__file__).resolve().parent


def run_mpi_script(nprocs: int, script: Path, *args: str, timeout_seconds: float = 600) -> None:
    """``script`` (beside its test) on ``nprocs`` ranks; fails the test with the ranks' output tails if it fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{script.parent}:{TESTS.parent / 'src'}"}
    command = mpirun_command(nprocs, [sys.executable, str(script), *args], env=["PYTHONPATH", "OMP_NUM_THREADS"])
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_seconds)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
