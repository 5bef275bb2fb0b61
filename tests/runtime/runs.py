"""Helpers for the runtime tests: run `restage run` in a subprocess on a tiny PPO job and read what it wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from restage.demo import ensure_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def tiny_assets() -> Path:
    return ensure_tiny_model(ROOT)


def restage_run(results: Path, *args: str, timeout: float = 600, env: dict | None = None, wait: bool = True):
    """``restage run`` from the repository root with results under ``results``; returns the CompletedProcess."""
    tiny_assets()
    command = [sys.executable, "-m", "restage.cli", "run", *args, f"run.results_dir={results}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'tests' / 'runtime'}:{ROOT / 'src'}",
                **(env or {})}
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a HF safetensors directory."""
    from safetensors.torch import load_file

    out = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def last_checkpoint(trial: Path) -> Path:
    from restage.runtime.checkpoint.checkpoint_dir import latest

    found = latest(trial)
    assert found is not None, f"no checkpoint under {trial}"
    return found


def rank_process(trial_marker, rank: int):
    """The live ``restage.runtime.spmd`` process of ``rank`` whose command line names ``trial_marker``, or None."""
    import psutil  # test-only dependency

    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "restage.runtime.spmd" in cmd and str(trial_marker) in cmd:
            try:
                if proc.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                    return proc
            except psutil.Error:
                continue
    return None
