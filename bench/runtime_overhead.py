"""Per-step overhead of the runtime itself, from a real run of trivial MFCs.

Runs the tiny PPO job (5 MFCs) with a batch of 2 prompts and 2 new tokens, so every MFC is a few
milliseconds, on 1 rank and on 2 ranks (colocated: no reallocation), and reads log.h5. For each
rank and step, overhead = step wall time - the time that rank spent inside MFCs and data / parameter
moves (a step runs from its start to the next one's); what remains is the runtime's own work:
sample ids and statistics over MPI, the master's
log writing and decisions, building batches. Reported per MFC (target: under 5 ms on CPU).

    python bench/runtime_overhead.py [--json] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MFCS = ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")


def measure(nprocs: int, steps: int, results: Path) -> dict:
    from restage.report.log import read_log

    layouts = [f"plan.layouts.{m}=ranks:0-{nprocs - 1} dp{nprocs}" for m in MFCS]
    command = [sys.executable, "-m", "restage.cli", "run", "jobs/ppo_tiny.yaml", "-n", str(nprocs), f"trial=overhead{nprocs}",
               f"run.steps={steps}", "run.batch_size=2", "generation.max_new_tokens=2", "algo.ppo_epochs=1",
               "algo.minibatches=1", f"run.results_dir={results}", "plan.mode=manual", *layouts, "--overwrite"]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    log = read_log(results / "ppo-tiny" / f"overhead{nprocs}")
    per_step = []
    starts = log.steps["start_seconds"]
    for index in range(2, len(log.steps) - 1):  # the first steps warm up (imports, first allocations)
        # The period from one step's start to the next one's includes the master's log writing and
        # the statistics / decision messages between steps.
        step, wall = log.steps["step"][index], starts[index + 1] - starts[index]
        worst = 0.0
        for rank in range(nprocs):
            busy = sum(r["end_seconds"] - r["start_seconds"] for r in log.mfcs if r["step"] == step and r["rank"] == rank)
            moves = sum(r["end_seconds"] - r["start_seconds"] for r in log.transfers
                        if r["step"] == step and r["rank"] == rank)
            worst = max(worst, wall - busy - moves)
        per_step.append(worst)
    seconds = float(np.median(per_step))
    mfc_seconds = float(np.median([r["end_seconds"] - r["start_seconds"] for r in log.mfcs]))
    return {"ranks": nprocs, "steps": steps, "mfcs_per_step": len(MFCS),
            "overhead_seconds_per_step": seconds, "overhead_seconds_per_mfc": seconds / len(MFCS),
            "median_mfc_seconds": mfc_seconds,
            "step_seconds": float(np.median(log.steps["end_seconds"] - log.steps["start_seconds"]))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    from restage.demo import ensure_tiny_model

    os.chdir(ROOT)
    ensure_tiny_model()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(n, args.steps, Path(tmp)) for n in (1, 2)]
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for r in rows:
            print(f"{r['ranks']} rank(s): step {r['step_seconds'] * 1e3:.1f} ms, runtime overhead "
                  f"{r['overhead_seconds_per_step'] * 1e3:.2f} ms/step = {r['overhead_seconds_per_mfc'] * 1e3:.2f} ms per MFC "
                  f"(median MFC {r['median_mfc_seconds'] * 1e3:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
