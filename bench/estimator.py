"""Predicted against measured time per MFC and per iteration of a small PPO job on this CPU, over several plans.

    python bench/estimator.py [--json] [--steps N] [--warmup K] [--only NAME] [--nice N] [--reuse]
    python bench/estimator.py --calibrate [--json] [--steps N] [--warmup K] [--nice N] [--reuse]

Every plan is a real run of jobs/ppo_tiny.yaml (2 ranks, batch 64, 24 generated tokens) under
``restage run`` with ``plan.mode=manual``. Measured: per MFC, the median over the steps after the
warm-up of the slowest of its ranks; per iteration, the median step time. Predicted: restage's
estimator and simulator for the same plan with the cluster file as it is now (``cluster/local-cpu.yaml``
and the measured profile under ``cluster/profiles/``).

``--calibrate`` runs a *different* set of jobs (one rank, other batch sizes, generation lengths,
micro-batch and minibatch counts, and one two-rank plan that is not among the evaluated ones),
fits the runtime's fixed overheads (per MFC call, sequence, micro-batch forward and backward,
decoding step, optimizer step, transfer, reallocation) by non-negative least squares on relative
error, and prints them as cluster-file lines. The evaluated plans never enter the fit.
``--reuse`` reads the logs of earlier runs instead of running again. ``--nice -19`` (root only)
lowers the share other processes take of this shared machine while measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from restage.config import config_from_dict, load_config
from restage.plan.estimator import OVERHEADS, overhead_counts

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "ppo_tiny.yaml"
EXPERIMENT = "estimator-bench"
MFCS = ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")
# The job: big enough that MFCs take tens of ms; answers always 24 tokens long so every step does the same work.
SIZE = {"run.batch_size": 64, "generation.max_new_tokens": 24, "generation.min_new_tokens": 24,
        "algo.ppo_epochs": 2, "algo.minibatches": 2, "run.micro_batches": 1}


def _all(layout: str) -> dict[str, str]:
    return {m: layout for m in MFCS}


def _split(actor: str, rest: str) -> dict[str, str]:
    return {m: (actor if m.startswith("actor") else rest) for m in MFCS}


# Evaluated plans: two ranks, the job above.
PLANS: dict[str, dict[str, str]] = {
    "colocated-dp2": _all("ranks:0-1 dp2"),
    "colocated-tp2": _all("ranks:0-1 tp2"),
    "colocated-pp2": _all("ranks:0-1 pp2"),
    "separated": _split("ranks:0 dp1", "ranks:1 dp1"),
    "single-rank": _all("ranks:0 dp1"),
    "gen-dp2-split": {**_split("ranks:0 dp1", "ranks:1 dp1"), "actor_gen": "ranks:0-1 dp2"},
    "gen-dp2-train-tp2": {**_all("ranks:0-1 dp2"), "actor_train": "ranks:0-1 tp2"},
    "gen-tp2-train-dp2": {**_all("ranks:0-1 dp2"), "actor_gen": "ranks:0-1 tp2"},
}
# Calibration runs: one rank with other job sizes, and one two-rank plan (generation alone on rank 0)
# for the transfers and the reallocation; none of them is an evaluated plan.
ONE_RANK = {"cluster.devices_per_node": 1}
CALIBRATION: dict[str, tuple[dict, dict[str, str]]] = {
    "cal-b64-g24-mb1-mini2-ep2": ({**ONE_RANK}, _all("ranks:0 dp1")),
    "cal-b64-g8-mb4-mini1-ep1": ({**ONE_RANK, "generation.max_new_tokens": 8, "generation.min_new_tokens": 8,
                                  "run.micro_batches": 4, "algo.minibatches": 1, "algo.ppo_epochs": 1}, _all("ranks:0 dp1")),
    "cal-b32-g16-mb2-mini4-ep1": ({**ONE_RANK, "run.batch_size": 32, "generation.max_new_tokens": 16,
                                   "generation.min_new_tokens": 16, "run.micro_batches": 2, "algo.minibatches": 4,
                                   "algo.ppo_epochs": 1}, _all("ranks:0 dp1")),
    "cal-b16-g32-mb1-mini1-ep2": ({**ONE_RANK, "run.batch_size": 16, "generation.max_new_tokens": 32,
                                   "generation.min_new_tokens": 32, "algo.minibatches": 1}, _all("ranks:0 dp1")),
    "cal-gen-apart": ({}, {**_all("ranks:1 dp1"), "actor_gen": "ranks:0 dp1"}),
}


def overrides_for(name: str, size: dict, layouts: dict[str, str], steps: int) -> list[str]:
    values = {**SIZE, **size, "experiment": EXPERIMENT, "trial": name, "run.steps": steps, "plan.mode": "manual",
              "run.save_every": 0, "run.keep_checkpoints": 1}
    values.update({f"plan.layouts.{m}": layout for m, layout in layouts.items()})
    return [f"{k}={v}" for k, v in values.items()]


def world_of(layouts: dict[str, str], size: dict) -> int:
    return 1 if size.get("cluster.devices_per_node") == 1 else 2


def run_job(name: str, size: dict, layouts: dict[str, str], steps: int, nice: int) -> Path:
    """One real run; returns its trial directory."""
    cmd = [sys.executable, "-m", "restage.cli", "run", str(JOB), "-n", str(world_of(layouts, size)),
           *overrides_for(name, size, layouts, steps), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def lower_others() -> None:
        if nice:
            try:
                os.nice(nice)
            except PermissionError:
                pass  # not root: measure at the normal priority

    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=lower_others)
    if done.returncode != 0:
        raise SystemExit(f"run {name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return ROOT / "results" / EXPERIMENT / name


def measure(trial: Path, warmup: int) -> dict:
    """Medians over the steps after ``warmup``: per MFC (slowest rank), per move op (fastest rank), per iteration."""
    from restage.report.log import read_log

    log = read_log(trial)
    per_mfc: dict[str, dict[int, float]] = defaultdict(dict)
    for r in log.mfcs:
        step, name = int(r["step"]), str(r["name"])
        if step >= warmup:
            per_mfc[name][step] = max(per_mfc[name].get(step, 0.0), float(r["end_seconds"] - r["start_seconds"]))
    moves: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in log.transfers:
        step = int(r["step"])
        if step >= warmup and str(r["src"]) != str(r["dst"]):
            key = (str(r["kind"]), str(r["name"]), str(r["src"]), str(r["dst"]))
            seconds = float(r["end_seconds"] - r["start_seconds"])
            moves[key][step] = min(moves[key].get(step, seconds), seconds)
    steps = [float(r["end_seconds"] - r["start_seconds"]) for r in log.steps if int(r["step"]) >= warmup]
    if not steps:
        raise SystemExit(f"{trial}: no steps after the warm-up of {warmup}; run more steps")
    return {"config": yaml.safe_load(log.config), "steps": len(steps), "iteration_seconds": statistics.median(steps),
            "mfc_seconds": {m: statistics.median(v.values()) for m, v in per_mfc.items()},
            "moves": [{"kind": k[0], "name": k[1], "src": k[2], "dst": k[3], "seconds": statistics.median(v.values())}
                      for k, v in moves.items()],
            "schedule_predicted_iteration_seconds": log.schedule["predicted"]["iteration_seconds"]}


def predict(config: dict, cluster=None) -> dict:
    """restage's prediction for the run's config and manual plan, with the current (or the given) cluster spec."""
    from restage.plan.evaluate import evaluate
    from restage.plan.planner import build_problem, manual_plan

    cfg = config_from_dict(config) if isinstance(config, dict) else config
    problem = build_problem(cfg, cluster)
    plan = manual_plan(cfg, problem)
    ev = evaluate(problem, plan)
    return {"problem": problem, "plan": plan, "iteration_seconds": ev.iteration_seconds,
            "mfc_seconds": {c.mfc: c.seconds for c in plan}, "sources": sorted({c.estimate.source for c in plan})}


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = np.array(ranks(xs)), np.array(ranks(ys))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    return float((rx * ry).sum() / np.sqrt((rx * rx).sum() * (ry * ry).sum()))


def nnls(a: np.ndarray, b: np.ndarray, sweeps: int = 5000) -> np.ndarray:
    """min |a x - b| with x >= 0 by cyclic coordinate descent (small problems only)."""
    x = np.zeros(a.shape[1])
    norms = (a * a).sum(0)
    for _ in range(sweeps):
        for j in range(a.shape[1]):
            if norms[j] > 0:
                r = b - a @ x + a[:, j] * x[j]
                x[j] = max(0.0, float(a[:, j] @ r) / norms[j])
    return x


def evaluate_runs(names: list[str], measured: dict[str, dict]) -> dict:
    rows, errors = [], []
    for name in names:
        got = measured[name]
        pred = predict(got["config"])
        mfcs = []
        for cand in pred["plan"]:
            meas = got["mfc_seconds"][cand.mfc]
            err = (pred["mfc_seconds"][cand.mfc] - meas) / meas
            errors.append(abs(err))
            mfcs.append({"mfc": cand.mfc, "layout": str(cand), "predicted_seconds": pred["mfc_seconds"][cand.mfc],
                         "measured_seconds": meas, "error": err})
        it_err = (pred["iteration_seconds"] - got["iteration_seconds"]) / got["iteration_seconds"]
        rows.append({"plan": name, "steps": got["steps"], "predicted_iteration_seconds": pred["iteration_seconds"],
                     "measured_iteration_seconds": got["iteration_seconds"], "iteration_error": it_err,
                     "estimator": pred["sources"], "mfcs": mfcs})
    rho = spearman([r["predicted_iteration_seconds"] for r in rows], [r["measured_iteration_seconds"] for r in rows])
    mae = statistics.median(errors)
    return {"plans": rows, "median_abs_mfc_error": mae, "spearman_iteration": rho,
            "median_abs_iteration_error": statistics.median(abs(r["iteration_error"]) for r in rows),
            "targets_met": {"median_abs_mfc_error<=0.25": mae <= 0.25, "spearman>=0.8": rho >= 0.8}}


def calibrate(measured: dict[str, dict]) -> dict:
    """Fit the overhead constants on the calibration runs (relative least squares, non-negative)."""
    import dataclasses

    from restage.cluster import cluster_from_config

    rows, targets, weights, labels = [], [], [], []
    transfer_excess, realloc_excess = [], []
    for name, got in measured.items():
        cfg = config_from_dict(got["config"])
        base = cluster_from_config(cfg)
        zero = dataclasses.replace(base, **{f"{k}_overhead_seconds": 0.0 for k in (*OVERHEADS, "transfer", "realloc")})
        pred = predict(cfg, zero)
        problem = pred["problem"]
        for cand in pred["plan"]:
            mfc = problem.graph[cand.mfc]
            counts = overhead_counts(mfc, cand.layout, cand.micro_batches)
            meas = got["mfc_seconds"][cand.mfc]
            rows.append([counts.get(k, 0.0) for k in OVERHEADS])
            targets.append(meas - pred["mfc_seconds"][cand.mfc])
            weights.append(1.0 / meas)
            labels.append(f"{name}/{cand.mfc}")
        for move in got["moves"]:
            excess = move["seconds"] - _move_prediction(problem, pred["plan"], move)
            (transfer_excess if move["kind"] == "transfer" else realloc_excess).append(excess)
    a = np.array(rows) * np.array(weights)[:, None]
    b = np.array(targets) * np.array(weights)
    x = nnls(a, b)
    fitted = {f"{k}_overhead_seconds": float(v) for k, v in zip(OVERHEADS, x)}
    fitted["transfer_overhead_seconds"] = max(0.0, statistics.median(transfer_excess)) if transfer_excess else 0.0
    fitted["realloc_overhead_seconds"] = max(0.0, statistics.median(realloc_excess)) if realloc_excess else 0.0
    residual = (np.array(rows) @ x - np.array(targets)) * np.array(weights)
    return {"constants": fitted, "runs": sorted(measured), "mfc_rows": len(rows),
            "fit_median_abs_relative_residual": float(np.median(np.abs(residual))),
            "moves": {"transfer": len(transfer_excess), "realloc": len(realloc_excess)}}


def _move_prediction(problem, plan, move: dict) -> float:
    from restage.plan.simulator import plan_program

    for op, seconds in plan_program(problem, plan):
        if op.kind == move["kind"] and str(op.src) == move["src"] and str(op.dst) == move["dst"] and \
                move["name"] in (op.key, op.model):
            return seconds
    return 0.0


def render(result: dict) -> str:
    lines = []
    for row in result["plans"]:
        lines.append(f"{row['plan']}: iteration predicted {row['predicted_iteration_seconds'] * 1e3:.1f} ms, measured "
                     f"{row['measured_iteration_seconds'] * 1e3:.1f} ms ({row['iteration_error']:+.0%}), {row['steps']} steps")
        for m in row["mfcs"]:
            lines.append(f"  {m['mfc']:<13} {m['layout']:<22} predicted {m['predicted_seconds'] * 1e3:8.1f} ms  "
                         f"measured {m['measured_seconds'] * 1e3:8.1f} ms  {m['error']:+6.0%}")
    lines.append(f"median |error| per MFC {result['median_abs_mfc_error']:.1%} (target <= 25%), per iteration "
                 f"{result['median_abs_iteration_error']:.1%}; Spearman of iteration times {result['spearman_iteration']:.3f} "
                 f"(target >= 0.8); targets met: {all(result['targets_met'].values())}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calibrate", action="store_true", help="run the calibration set and fit the overheads")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--only", default="", help="comma-separated plan names")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the runs (negative needs root)")
    parser.add_argument("--reuse", action="store_true", help="read the logs of earlier runs instead of running")
    args = parser.parse_args(argv)
    load_config(JOB)  # refuses a broken job before any run
    from restage.demo import ensure_tiny_model

    ensure_tiny_model()
    chosen = CALIBRATION if args.calibrate else PLANS
    names = [n for n in chosen if not args.only or n in args.only.split(",")]
    measured, started = {}, time.time()
    for name in names:
        size, layouts = chosen[name] if args.calibrate else ({}, chosen[name])
        trial = ROOT / "results" / EXPERIMENT / name
        if not args.reuse:
            load = os.getloadavg()[0]
            trial = run_job(name, size, layouts, args.steps, args.nice)
            if not args.json:
                print(f"ran {name} ({time.time() - started:.0f} s so far, load average {load:.1f})", flush=True)
        measured[name] = measure(trial, args.warmup)
    if args.calibrate:
        result = calibrate(measured)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            print(f"fitted on {result['mfc_rows']} MFC timings of {len(result['runs'])} runs "
                  f"({result['moves']['transfer']} transfers, {result['moves']['realloc']} reallocations); median |relative "
                  f"residual| {result['fit_median_abs_relative_residual']:.1%}. Cluster-file lines:")
            for key, value in result["constants"].items():
                print(f"{key}: {value:.3g}")
        return 0
    result = evaluate_runs(names, measured)
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
