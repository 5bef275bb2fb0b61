"""restage's estimator against real runs of a small PPO job on this CPU: calibrated on one set, scored on a disjoint one.

    python bench/estimator.py --both [--rounds R] [--steps N] [--warmup K] [--json]   # the whole check
    python bench/estimator.py --calibrate [...]     # the calibration set only: the fitted constants, per round
    python bench/estimator.py [...]                 # the evaluation set only, with the cluster file's constants
    python bench/estimator.py --both --rounds R --reuse [--json]   # score the logs of earlier runs again

Every job is a real run of jobs/ppo_tiny.yaml on 2 ranks under ``restage run`` with ``plan.mode=manual``.
Measured: per MFC, the median over the steps after the warm-up of the slowest of its ranks; per
iteration, the median step time; over R rounds, the median of the rounds' medians.

The two sets share nothing but the machine and the program:

* ``CALIBRATION``: the tiny LLaMA of results/assets/tiny-llama (hidden 64, 2 layers), batch 16-64, 8-32
  generated tokens, 1-4 micro-batches, 1-4 minibatches, 1-2 epochs, on four layouts: everything on
  rank 0, everything dp2, everything tp2, generation on rank 0 and the rest on rank 1. The
  runtime's fixed overheads (per MFC call, sequence, micro-batch forward and backward, decoding
  step, optimizer step, transfer, reallocation) and the gloo collectives' latency are fitted on
  it by non-negative least absolute relative error. With R rounds the constants are also fitted
  on each round alone: ``stability`` gives each constant's relative spread between the fits of
  fresh runs (target: within 20%).
* ``PLANS`` (evaluated, never fitted): another model (``EVAL_MODEL``: hidden 96, 3 layers, made in
  results/assets/tiny-llama-96 on first use; no measured profile, so its compute is the roofline's),
  another job size (``EVAL_SIZE``: batch 40, 20 generated tokens), and 11 layouts none of which is a
  calibration layout. Predicted with the constants fitted on the calibration set (``--both``) or
  the cluster file's (evaluation alone). ``--json`` gives the median |error| per MFC (target
  <= 20%) and the Spearman rank correlation of the iteration times over the plans (>= 0.85).

On a shared machine step times move by 2-5x with other work; ``--nice -19`` (root only) lowers the
share other processes take. The figures are only as good as the machine is quiet.
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

from restage.config.load import config_from_dict, load_config
from restage.plan.estimator import OVERHEADS, overhead_counts
from restage.schedule.ops import Realloc, SendKey

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "ppo_tiny.yaml"
EXPERIMENT = "estimator-bench"
LATENCY_PROBE_SECONDS = 1e-3
MFCS = ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")
# The job: big enough that MFCs take tens of ms; answers always 24 tokens long so every step does the same work.
SIZE = {"run.batch_size": 64, "generation.max_new_tokens": 24, "generation.min_new_tokens": 24,
        "algo.ppo_epochs": 2, "algo.minibatches": 2, "run.micro_batches": 1}


def _all(layout: str) -> dict[str, str]:
    return {m: layout for m in MFCS}


def _split(actor: str, rest: str) -> dict[str, str]:
    return {m: (actor if m.startswith("actor") else rest) for m in MFCS}


# The calibration set: the tiny model, its own job sizes, four layouts. All on two ranks, so they share the evaluated
# runs' conditions (on this 2-core machine a second rank busy-waiting in MPI matters).
def _size(batch: int, gen: int, mb: int, minibatches: int, epochs: int) -> dict:
    return {"run.batch_size": batch, "generation.max_new_tokens": gen, "generation.min_new_tokens": gen,
            "run.micro_batches": mb, "algo.minibatches": minibatches, "algo.ppo_epochs": epochs}


RANK0, DP2, TP2 = _all("ranks:0 dp1"), _all("ranks:0-1 dp2"), _all("ranks:0-1 tp2")
GEN_APART = {**_all("ranks:1 dp1"), "actor_gen": "ranks:0 dp1"}
CALIBRATION: dict[str, tuple[dict, dict[str, str]]] = {
    "cal-rank0-b48-g16-mb1-mini2-ep2": (_size(48, 16, 1, 2, 2), RANK0),
    "cal-rank0-b64-g8-mb4-mini1-ep1": (_size(64, 8, 4, 1, 1), RANK0),
    "cal-rank0-b32-g16-mb2-mini4-ep1": (_size(32, 16, 2, 4, 1), RANK0),
    "cal-rank0-b16-g32-mb1-mini1-ep2": (_size(16, 32, 1, 1, 2), RANK0),
    "cal-dp2-b32-g16-mb2-mini1-ep1": (_size(32, 16, 2, 1, 1), DP2),
    "cal-tp2-b32-g8-mb1-mini2-ep1": (_size(32, 8, 1, 2, 1), TP2),
    "cal-gen-apart-b64-g24": (_size(64, 24, 1, 2, 2), GEN_APART),
}

# The evaluated set: another model and job size, layouts the calibration never ran.
EVAL_MODEL = {"hidden_size": 96, "intermediate_size": 256, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2}
EVAL_MODEL_PATH = "results/assets/tiny-llama-96"
EVAL_SIZE = {**_size(40, 20, 1, 2, 2), **{f"models.{m}.path": EVAL_MODEL_PATH for m in ("actor", "critic", "ref")}}
PLANS: dict[str, dict[str, str]] = {
    "colocated-pp2": _all("ranks:0-1 pp2"),
    "separated": _split("ranks:0 dp1", "ranks:1 dp1"),
    "gen-dp2-split": {**_split("ranks:0 dp1", "ranks:1 dp1"), "actor_gen": "ranks:0-1 dp2"},
    "gen-dp2-train-tp2": {**DP2, "actor_train": "ranks:0-1 tp2"},
    "gen-tp2-train-dp2": {**DP2, "actor_gen": "ranks:0-1 tp2"},
    "critic-tp2": {**DP2, "critic_inf": "ranks:0-1 tp2", "critic_train": "ranks:0-1 tp2"},
    "train-pp2": {**DP2, "actor_train": "ranks:0-1 pp2", "critic_train": "ranks:0-1 pp2"},
    "gen-pp2": {**DP2, "actor_gen": "ranks:0-1 pp2"},
    "inference-split": {**DP2, "ref_inf": "ranks:0 dp1", "critic_inf": "ranks:1 dp1"},
    "trains-apart": {**DP2, "actor_train": "ranks:0 dp1", "critic_train": "ranks:1 dp1"},
    "gen-tp2-train-pp2": {**DP2, "actor_gen": "ranks:0-1 tp2", "actor_train": "ranks:0-1 pp2",
                          "critic_train": "ranks:0-1 pp2"},
}
assert not {tuple(sorted(p.items())) for p in PLANS.values()} & \
    {tuple(sorted(layouts.items())) for _, layouts in CALIBRATION.values()}, "an evaluated layout is a calibration layout"


def ensure_model(relative: str, seed: int, **sizes: int) -> Path:
    """A random LLaMA of ``sizes`` over the synthetic task's tokenizer at ``ROOT / relative`` (built once)."""
    import shutil

    from restage.demo import TOKENIZER
    from restage.models.tiny import build_tiny

    path = ROOT / relative
    if (path / "config.json").is_file():
        return path
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(tmp, family="llama", seed=seed, vocab_size=16, tokenizer=False, max_positions=64, **sizes)
    for file in (ROOT / TOKENIZER).iterdir():
        shutil.copy(file, tmp / file.name)
    tmp.replace(path)
    return path


def ensure_eval_model() -> Path:
    """The evaluation's model: a random LLaMA of ``EVAL_MODEL``'s size (built once)."""
    return ensure_model(EVAL_MODEL_PATH, 1, **EVAL_MODEL)


def overrides_for(name: str, size: dict, layouts: dict[str, str], steps: int, experiment: str = EXPERIMENT) -> list[str]:
    values = {**SIZE, **size, "experiment": experiment, "trial": name, "run.steps": steps, "plan.mode": "manual",
              "run.save_every": 0, "run.keep_checkpoints": 1}
    values.update({f"plan.layouts.{m}": layout for m, layout in layouts.items()})
    return [f"{k}={v}" for k, v in values.items()]


def run_job(name: str, size: dict, layouts: dict[str, str], steps: int, nice: int, ranks: int = 2,
            experiment: str = EXPERIMENT) -> Path:
    """One real run on ``ranks`` ranks (each on one thread unless ``size`` sets run.threads_per_rank); returns its
    trial directory."""
    cmd = [sys.executable, "-m", "restage.cli", "run", str(JOB), "-n", str(ranks),
           *overrides_for(name, size, layouts, steps, experiment), "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def lower_others() -> None:
        if nice:
            try:
                os.nice(nice)
            except PermissionError:
                pass  # not root: measure at the normal priority

    for attempt in range(2):  # one retry: other work on a shared checkout can break a run for a moment
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, preexec_fn=lower_others)
        if done.returncode == 0:
            return ROOT / "results" / experiment / name
        print(f"run {name} failed ({done.returncode}): {(done.stdout + done.stderr).strip().splitlines()[-1:]}",
              file=sys.stderr, flush=True)
        time.sleep(20 * (attempt + 1))
    raise SystemExit(f"run {name} failed twice:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


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
    from restage.plan.plan_score import evaluate
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


def with_constants(config: dict, constants: dict[str, float] | None):
    """The run's cluster spec with the fitted constants in place of the cluster file's (None: the file's)."""
    import dataclasses

    from restage.cluster import cluster_from_config

    if not constants:
        return None
    return dataclasses.replace(cluster_from_config(config_from_dict(config)), **constants)


MFC_TARGET, SPEARMAN_TARGET = 0.20, 0.85  # issue 15, item 4: held-out median |error| per MFC, rank correlation


def evaluate_runs(names: list[str], measured: dict[str, dict], constants: dict[str, float] | None = None) -> dict:
    rows, errors = [], []
    by_mfc: dict[str, list[float]] = defaultdict(list)
    for name in names:
        got = measured[name]
        pred = predict(got["config"], with_constants(got["config"], constants))
        mfcs = []
        for cand in pred["plan"]:
            meas = got["mfc_seconds"][cand.mfc]
            err = (pred["mfc_seconds"][cand.mfc] - meas) / meas
            errors.append(abs(err))
            by_mfc[cand.mfc].append(abs(err))
            mfcs.append({"mfc": cand.mfc, "layout": str(cand), "predicted_seconds": pred["mfc_seconds"][cand.mfc],
                         "measured_seconds": meas, "error": err})
        it_err = (pred["iteration_seconds"] - got["iteration_seconds"]) / got["iteration_seconds"]
        rows.append({"plan": name, "steps": got["steps"], "predicted_iteration_seconds": pred["iteration_seconds"],
                     "measured_iteration_seconds": got["iteration_seconds"], "iteration_error": it_err,
                     "estimator": pred["sources"], "mfcs": mfcs})
    rho = spearman([r["predicted_iteration_seconds"] for r in rows], [r["measured_iteration_seconds"] for r in rows])
    per_mfc = {m: statistics.median(v) for m, v in by_mfc.items()}
    return {"plans": rows, "constants": "fitted on the calibration set" if constants else "the cluster file's",
            "median_abs_mfc_error": statistics.median(errors), "median_abs_error_per_mfc": per_mfc,
            "spearman_iteration": rho,
            "median_abs_iteration_error": statistics.median(abs(r["iteration_error"]) for r in rows),
            "targets_met": {f"median_abs_error_per_mfc<={MFC_TARGET:.2f}": all(v <= MFC_TARGET for v in per_mfc.values()),
                            f"spearman>={SPEARMAN_TARGET}": rho >= SPEARMAN_TARGET}}


def stability(fits: list[dict[str, float]]) -> dict:
    """Per constant: (max - min) / max over the fits of separate rounds; a constant 0 in every fit is stable (0)."""
    spread = {}
    for key in fits[0]:
        values = [f[key] for f in fits]
        top = max(values)
        spread[key] = 0.0 if top <= 0 else (top - min(values)) / top
    return {"fits": fits, "relative_spread": spread, "within_20_percent": all(v <= 0.2 for v in spread.values())}


def calibrate(measured: dict[str, dict]) -> dict:
    """Fit the overhead constants on the calibration runs (relative least squares, non-negative)."""
    import dataclasses

    from restage.cluster import cluster_from_config

    rows, targets, weights, labels = [], [], [], []
    transfer_excess, realloc_excess = [], []
    for name, got in measured.items():
        cfg = config_from_dict(got["config"])
        base = cluster_from_config(cfg)
        zero = dataclasses.replace(base, intra_node_latency_seconds=0.0,
                                   **{f"{k}_overhead_seconds": 0.0 for k in (*OVERHEADS, "transfer", "realloc")})
        pred = predict(cfg, zero)
        # Seconds per second of collective latency: the estimate is linear in it.
        per_latency = predict(cfg, dataclasses.replace(zero, intra_node_latency_seconds=LATENCY_PROBE_SECONDS))
        problem = pred["problem"]
        for cand in pred["plan"]:
            mfc = problem.graph[cand.mfc]
            counts = overhead_counts(mfc, cand.layout, cand.micro_batches)
            meas = got["mfc_seconds"][cand.mfc]
            latency_units = (per_latency["mfc_seconds"][cand.mfc] - pred["mfc_seconds"][cand.mfc]) / LATENCY_PROBE_SECONDS
            rows.append([counts.get(k, 0.0) for k in OVERHEADS] + [latency_units])
            targets.append(meas - pred["mfc_seconds"][cand.mfc])
            weights.append(1.0 / meas)
            labels.append(f"{name}/{cand.mfc}")
        for move in got["moves"]:
            excess = move["seconds"] - _move_prediction(problem, pred["plan"], move)
            (transfer_excess if move["kind"] == "transfer" else realloc_excess).append(excess)
    a = np.array(rows) * np.array(weights)[:, None]
    b = np.array(targets) * np.array(weights)
    x = nnls(a, b)
    for _ in range(20):  # least absolute relative error (iteratively reweighted): one noisy run moves it less
        w = 1.0 / np.sqrt(np.maximum(np.abs(a @ x - b), 0.02))
        x = nnls(a * w[:, None], b * w)
    fitted = {f"{k}_overhead_seconds": float(v) for k, v in zip(OVERHEADS, x)}
    fitted["intra_node_latency_seconds"] = float(x[-1])
    fitted["transfer_overhead_seconds"] = max(0.0, statistics.median(transfer_excess)) if transfer_excess else 0.0
    fitted["realloc_overhead_seconds"] = max(0.0, statistics.median(realloc_excess)) if realloc_excess else 0.0
    residual = (np.array(rows) @ x - np.array(targets)) * np.array(weights)
    return {"constants": fitted, "runs": sorted(measured), "mfc_rows": len(rows),
            "fit_median_abs_relative_residual": float(np.median(np.abs(residual))),
            "moves": {"transfer": len(transfer_excess), "realloc": len(realloc_excess)}}


def _move_prediction(problem, plan, move: dict) -> float:
    from restage.plan.simulator import plan_program

    for op, seconds in plan_program(problem, plan):
        if isinstance(op, Realloc | SendKey) and op.kind == move["kind"] and str(op.src) == move["src"] \
                and str(op.dst) == move["dst"] and move["name"] == (op.model if isinstance(op, Realloc) else op.key):
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
    per_mfc = ", ".join(f"{m} {v:.1%}" for m, v in result["median_abs_error_per_mfc"].items())
    lines.append(f"held-out median |error| per MFC: {per_mfc} (target <= {MFC_TARGET:.0%} each); all MFCs "
                 f"{result['median_abs_mfc_error']:.1%}; per iteration {result['median_abs_iteration_error']:.1%}; Spearman of "
                 f"iteration times {result['spearman_iteration']:.3f} (target >= {SPEARMAN_TARGET}); constants: "
                 f"{result['constants']}; targets met: {all(result['targets_met'].values())}")
    return "\n".join(lines)


def combine(runs: list[dict]) -> dict:
    """One figure per plan from several runs of it: the median of the runs' medians."""
    out = dict(runs[0])
    out["runs"] = len(runs)
    out["steps"] = sum(r["steps"] for r in runs)
    out["iteration_seconds"] = statistics.median(r["iteration_seconds"] for r in runs)
    out["mfc_seconds"] = {m: statistics.median(r["mfc_seconds"][m] for r in runs) for m in runs[0]["mfc_seconds"]}
    moves = defaultdict(list)
    for r in runs:
        for move in r["moves"]:
            moves[(move["kind"], move["name"], move["src"], move["dst"])].append(move["seconds"])
    out["moves"] = [{"kind": k[0], "name": k[1], "src": k[2], "dst": k[3], "seconds": statistics.median(v)}
                    for k, v in moves.items()]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calibrate", action="store_true", help="fit the overheads on the calibration runs")
    parser.add_argument("--both", action="store_true", help="run the calibration and evaluation sets interleaved")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every job (interleaved); figures are medians")
    parser.add_argument("--first-round", type=int, default=0, help="run rounds first-round .. rounds-1 (earlier ones reused)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--only", default="", help="comma-separated plan names")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the runs (negative needs root)")
    parser.add_argument("--reuse", action="store_true", help="read the logs of earlier runs instead of running")
    args = parser.parse_args(argv)
    load_config(JOB)  # refuses a broken job before any run
    from restage.demo import ensure_tiny_model

    ensure_tiny_model()
    jobs = {n: v for n, v in CALIBRATION.items()} if (args.calibrate or args.both) else {}
    if not args.calibrate or args.both:
        ensure_eval_model()
        jobs.update({n: (EVAL_SIZE, layouts) for n, layouts in PLANS.items() if not args.only or n in args.only.split(",")})
    order = _interleaved([n for n in jobs if n in CALIBRATION], [n for n in jobs if n not in CALIBRATION])
    runs: dict[str, list[dict]] = defaultdict(list)
    started = time.time()
    for k in range(args.rounds):
        for name in order:
            trial = f"{name}-r{k}"
            if not args.reuse and k >= args.first_round:
                load = os.getloadavg()[0]
                run_job(trial, *jobs[name], args.steps, args.nice)
                if not args.json:
                    print(f"ran {trial} ({time.time() - started:.0f} s so far, load average {load:.1f})", flush=True)
            runs[name].append(measure(ROOT / "results" / EXPERIMENT / trial, args.warmup))
    measured = {name: combine(r) for name, r in runs.items()}
    out: dict = {"load_average_after": os.getloadavg(), "rounds": args.rounds}
    constants = None
    if args.calibrate or args.both:
        out["calibration"] = calibrate({n: m for n, m in measured.items() if n in CALIBRATION})
        constants = out["calibration"]["constants"]
        if args.rounds > 1:  # one fit per round of fresh runs: are the constants identified?
            out["calibration"]["stability"] = stability(
                [calibrate({n: runs[n][k] for n in runs if n in CALIBRATION})["constants"] for k in range(args.rounds)])
        if not args.json:
            print(render_calibration(out["calibration"]))
    if not args.calibrate or args.both:
        evaluated = [n for n in measured if n not in CALIBRATION]
        out["evaluation"] = evaluate_runs(evaluated, measured, constants)
        if constants:  # the same plans with the cluster file's constants, for comparison
            out["evaluation_with_cluster_file"] = evaluate_runs(evaluated, measured)
        if not args.json:
            print(render(out["evaluation"]))
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


def _interleaved(a: list[str], b: list[str]) -> list[str]:
    out = []
    for i in range(max(len(a), len(b))):
        out += a[i:i + 1] + b[i:i + 1]
    return out


def render_calibration(result: dict) -> str:
    lines = [f"fitted on {result['mfc_rows']} MFC timings of {len(result['runs'])} calibration jobs "
             f"({result['moves']['transfer']} transfers, {result['moves']['realloc']} reallocations); median |relative "
             f"residual| {result['fit_median_abs_relative_residual']:.1%}. Cluster-file lines:"]
    lines += [f"{key}: {value:.3g}" for key, value in result["constants"].items()]
    if "stability" in result:
        spread = result["stability"]["relative_spread"]
        lines.append("spread between the fits of separate rounds (max - min) / max: "
                     + ", ".join(f"{k.removesuffix('_seconds')} {v:.0%}" for k, v in spread.items())
                     + f"; within 20%: {result['stability']['within_20_percent']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
