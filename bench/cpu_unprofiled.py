"""A held-out check of the CPU roofline for models without a measured profile: ten PPO jobs of widths, depths and
layouts that neither the calibration nor the evaluation of ``bench/estimator.py`` ran.

    python bench/cpu_unprofiled.py [--set NAME] [--rounds R] [--steps N] [--warmup K] [--nice -19] [--reuse]
                                   [--run-only] [--profiles DIR] [--json]

Three sets (``SETS``), each fixed and committed before any of its jobs was run or predicted, and not changed after its
result is seen. ``2026-11-28`` (the default; ``MODELS``, ``JOBS``, ``SIZE``) was predicted once by the roofline of
781df7b and missed the per-MFC target; its runs and its models' profiles then became fit data for the roofline's
CPU terms (``bench/cpu_roofline_fit.py``). ``2026-11-29`` (``FRESH_MODELS``, ``FRESH_JOBS``, ``FRESH_SIZE``) is the
fresh held-out set for that roofline: ten other widths and depths (144-768 wide, 2-8 layers), the same six kinds of
layout on other models, the same job size but with PPO's early stop off (``algo.early_stop_ratio=0``: under
jobs/ppo_tiny.yaml's 3.0 a random actor's ratio stops its later minibatches, so actor training did less work than
any estimate assumes, which the first set's actor_train errors show). ``2026-11-29-b`` (``THIRD_MODELS``,
``THIRD_JOBS``, the fresh set's size) was fixed after the fresh set's profiled prediction showed one-rank runs 73-74%
faster than their one-thread profiles, and before restage changed how a profile's threads count: the held-out set for
that change, and a second one for the roofline of ea5992e.

Each job is a real run of jobs/ppo_tiny.yaml (actor, critic, reference; the synthetic task)
under ``restage run`` with ``plan.mode=manual``, on a random LLaMA of the job's shape built once under
results/assets/ (no profile exists for it, so every estimate is the roofline's). Measured as ``bench/estimator.py``
measures (per MFC the median over the steps after the warm-up of its slowest rank; per iteration the median step
time; over rounds the median). Predicted as ``restage plan`` predicts, with the cluster file's constants, and the
band ``restage plan`` prints (``restage.accuracy.prediction_band``).

Targets (issue 30): median |error| per MFC <= 25%, and every measured iteration inside the printed band in at
least 8 of the 10 jobs. Progress goes to stderr, one line a run.

``--profiles DIR`` predicts the same runs as profiled plans: each job's model is profiled once on this machine
(``restage profile``, ``PROFILE_GRID``) into ``DIR/profiles/`` (never into cluster/profiles, so the set stays
unprofiled for everyone else), and the planner finds them there (``RESTAGE_CLUSTER_DIR=DIR``). That gives the
profiled plans' band its own held-out set (``restage.accuracy.CPU_PROFILED``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from estimator import MFCS, ROOT, ensure_model, measure, predict, run_job  # noqa: E402  (bench/ is not a package)

EXPERIMENT = "cpu-unprofiled"
# (width, layers, heads, kv heads, MLP width): none of them the calibration's (64 x 2) or the evaluation's (96 x 3).
# Heads and KV heads divide by 2 wherever a job splits the model over tp2.
MODELS = {
    "w128-l2": (128, 2, 4, 2, 384),
    "w160-l6": (160, 6, 4, 2, 448),
    "w192-l3": (192, 3, 6, 2, 512),
    "w256-l4": (256, 4, 8, 4, 704),
    "w320-l2": (320, 2, 10, 10, 864),
    "w384-l5": (384, 5, 6, 2, 1024),
    "w448-l3": (448, 3, 8, 4, 1216),
    "w512-l6": (512, 6, 8, 4, 1376),
    "w576-l2": (576, 2, 8, 2, 1536),
    "w640-l4": (640, 4, 10, 10, 1728),
}


def _all(layout: str) -> dict[str, str]:
    return {m: layout for m in MFCS}


# Six layouts; "one rank" runs on a single rank with both cores (run.threads_per_rank=2), the rest on two ranks of
# one thread each.
ONE_RANK = _all("ranks:0 dp1")
DP2, TP2, PP2 = _all("ranks:0-1 dp2"), _all("ranks:0-1 tp2"), _all("ranks:0-1 pp2")
APART = {m: ("ranks:0 dp1" if m.startswith("actor") else "ranks:1 dp1") for m in MFCS}
GEN_TP2 = {**DP2, "actor_gen": "ranks:0-1 tp2"}
# name: (model, layout, ranks)
JOBS: dict[str, tuple[str, dict[str, str], int]] = {
    "w128-l2-one-rank": ("w128-l2", ONE_RANK, 1),
    "w160-l6-dp2": ("w160-l6", DP2, 2),
    "w192-l3-apart": ("w192-l3", APART, 2),
    "w256-l4-one-rank": ("w256-l4", ONE_RANK, 1),
    "w320-l2-tp2": ("w320-l2", TP2, 2),
    "w384-l5-pp2": ("w384-l5", PP2, 2),
    "w448-l3-gen-tp2": ("w448-l3", GEN_TP2, 2),
    "w512-l6-dp2": ("w512-l6", DP2, 2),
    "w576-l2-apart": ("w576-l2", APART, 2),
    "w640-l4-tp2": ("w640-l4", TP2, 2),
}
# The job size: batch 32, answers always 16 tokens, 2 PPO epochs over 2 minibatches.
SIZE = {"run.batch_size": 32, "generation.max_new_tokens": 16, "generation.min_new_tokens": 16,
        "run.micro_batches": 1, "algo.minibatches": 2, "algo.ppo_epochs": 2}

# The fresh set (2026-11-29): widths and depths that neither the first set, the calibration (64 x 2) nor the
# evaluation (96 x 3) ran. Heads and KV heads divide by 2 (tp2).
FRESH_MODELS = {
    "w144-l8": (144, 8, 4, 2, 384),
    "w224-l5": (224, 5, 4, 2, 608),
    "w288-l2": (288, 2, 6, 2, 768),
    "w352-l4": (352, 4, 8, 4, 960),
    "w416-l3": (416, 3, 8, 2, 1120),
    "w480-l2": (480, 2, 10, 10, 1280),
    "w544-l3": (544, 3, 8, 4, 1472),
    "w608-l2": (608, 2, 8, 2, 1632),
    "w704-l3": (704, 3, 8, 4, 1888),
    "w768-l2": (768, 2, 12, 4, 2048),
}
FRESH_JOBS: dict[str, tuple[str, dict[str, str], int]] = {
    "w144-l8-pp2": ("w144-l8", PP2, 2),
    "w224-l5-one-rank": ("w224-l5", ONE_RANK, 1),
    "w288-l2-gen-tp2": ("w288-l2", GEN_TP2, 2),
    "w352-l4-apart": ("w352-l4", APART, 2),
    "w416-l3-dp2": ("w416-l3", DP2, 2),
    "w480-l2-tp2": ("w480-l2", TP2, 2),
    "w544-l3-one-rank": ("w544-l3", ONE_RANK, 1),
    "w608-l2-dp2": ("w608-l2", DP2, 2),
    "w704-l3-apart": ("w704-l3", APART, 2),
    "w768-l2-tp2": ("w768-l2", TP2, 2),
}
FRESH_SIZE = {**SIZE, "algo.early_stop_ratio": 0}
# The third set (2026-11-29-b), fixed after the fresh set's profiled prediction and before the change it prompted (a
# profile taken on one thread applied to a rank of two): other widths and depths again, three one-rank jobs.
THIRD_MODELS = {
    "w176-l4": (176, 4, 4, 2, 480),
    "w208-l10": (208, 10, 4, 2, 576),
    "w240-l6": (240, 6, 6, 2, 640),
    "w272-l3": (272, 3, 8, 4, 736),
    "w336-l2": (336, 2, 6, 6, 896),
    "w400-l4": (400, 4, 8, 4, 1088),
    "w464-l2": (464, 2, 8, 2, 1248),
    "w528-l4": (528, 4, 8, 4, 1408),
    "w592-l3": (592, 3, 8, 4, 1600),
    "w656-l2": (656, 2, 8, 2, 1760),
}
THIRD_JOBS: dict[str, tuple[str, dict[str, str], int]] = {
    "w176-l4-one-rank": ("w176-l4", ONE_RANK, 1),
    "w208-l10-pp2": ("w208-l10", PP2, 2),
    "w240-l6-dp2": ("w240-l6", DP2, 2),
    "w272-l3-gen-tp2": ("w272-l3", GEN_TP2, 2),
    "w336-l2-tp2": ("w336-l2", TP2, 2),
    "w400-l4-one-rank": ("w400-l4", ONE_RANK, 1),
    "w464-l2-apart": ("w464-l2", APART, 2),
    "w528-l4-dp2": ("w528-l4", DP2, 2),
    "w592-l3-tp2": ("w592-l3", TP2, 2),
    "w656-l2-one-rank": ("w656-l2", ONE_RANK, 1),
}
# name: (models, jobs, size, experiment under results/)
SETS = {"2026-11-28": (MODELS, JOBS, SIZE, EXPERIMENT),
        "2026-11-29": (FRESH_MODELS, FRESH_JOBS, FRESH_SIZE, f"{EXPERIMENT}-2026-11-29"),
        "2026-11-29-b": (THIRD_MODELS, THIRD_JOBS, FRESH_SIZE, f"{EXPERIMENT}-2026-11-29-b")}
DEFAULT_SET = "2026-11-28"
ALL_MODELS = {name: shape for models, _, _, _ in SETS.values() for name, shape in models.items()}
# restage profile's grid for --profiles: covers the jobs' per-rank batches (1-32) and sequences (prompt + 16 tokens).
PROFILE_GRID = ["--batches", "1,4,16,32", "--seqs", "8,16,32,64", "--tp", "1,2", "--repeats", "9"]
TARGET_MFC_ERROR = 0.25
TARGET_IN_BAND = 8


def model_path(model: str) -> str:
    return f"results/assets/cpu-unprofiled-{model}"


def ensure_job_model(model: str) -> Path:
    """A random LLaMA of ``model``'s shape (a model of any of ``SETS``) over the synthetic task's tokenizer (built
    once)."""
    width, layers, heads, kv_heads, inter = ALL_MODELS[model]
    return ensure_model(model_path(model), 2, hidden_size=width, num_layers=layers, num_heads=heads,
                        num_kv_heads=kv_heads, intermediate_size=inter)


def size_of(name: str, chosen: str = DEFAULT_SET) -> dict:
    _, jobs, base, _ = SETS[chosen]
    model, _, ranks = jobs[name]
    size = {**base, **{f"models.{m}.path": model_path(model) for m in ("actor", "critic", "ref")}}
    if ranks == 1:
        size["run.threads_per_rank"] = 2
    return size


def ensure_profile(model: str, directory: Path) -> None:
    """``model``'s profile on this machine under ``directory/profiles`` (measured once; progress on stderr)."""
    import subprocess

    out = directory / "profiles" / f"local-cpu--cpu-unprofiled-{model}--fp32.json"
    if out.is_file():
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "restage.cli", "profile", "--model", str(ROOT / model_path(model)),
                    *PROFILE_GRID, "--out", str(out)], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   check=True, stdout=sys.stderr)  # its progress is not the result


def score(name: str, measured: dict) -> dict:
    """One job's measured and predicted seconds (per MFC and per iteration) and whether it fell in the band."""
    from restage.accuracy import prediction_band, profiled

    pred = predict(measured["config"])
    band = prediction_band(pred["problem"].cluster.has_gpus, profiled=profiled(pred["sources"]))
    low, high = band.seconds(pred["iteration_seconds"])
    mfcs = {m: {"predicted_seconds": pred["mfc_seconds"][m], "measured_seconds": measured["mfc_seconds"][m],
                "error": pred["mfc_seconds"][m] / measured["mfc_seconds"][m] - 1} for m in MFCS}
    it = measured["iteration_seconds"]
    return {"job": name, "sources": pred["sources"], "mfcs": mfcs, "measured_iteration_seconds": it,
            "predicted_iteration_seconds": pred["iteration_seconds"], "band_seconds": [low, high],
            "in_band": low <= it <= high, "iteration_error": pred["iteration_seconds"] / it - 1}


def summarise(rows: list[dict]) -> dict:
    per_mfc = {m: statistics.median(abs(r["mfcs"][m]["error"]) for r in rows) for m in MFCS}
    in_band = sum(r["in_band"] for r in rows)
    return {"median_abs_error_per_mfc": per_mfc,
            "median_abs_iteration_error": statistics.median(abs(r["iteration_error"]) for r in rows),
            "in_band": in_band, "jobs": len(rows),
            "targets": {"mfc_error_met": all(e <= TARGET_MFC_ERROR for e in per_mfc.values()),
                        "in_band_met": in_band >= TARGET_IN_BAND}}


def render(result: dict) -> str:
    lines = []
    for r in result["jobs"]:
        low, high = r["band_seconds"]
        lines.append(f"{r['job']:<18} iteration measured {r['measured_iteration_seconds'] * 1e3:7.1f} ms, predicted "
                     f"{r['predicted_iteration_seconds'] * 1e3:7.1f} ({r['iteration_error']:+.0%}), band "
                     f"{low * 1e3:.0f}-{high * 1e3:.0f} {'in' if r['in_band'] else 'OUT'}")
        lines.append("    " + "  ".join(f"{m} {v['error']:+.0%}" for m, v in r["mfcs"].items()))
    s = result["summary"]
    lines.append("median |error| per MFC: " + ", ".join(f"{m} {e:.1%}" for m, e in s["median_abs_error_per_mfc"].items())
                 + f" (target <= {TARGET_MFC_ERROR:.0%}); iteration {s['median_abs_iteration_error']:.1%}; "
                 f"{s['in_band']} of {s['jobs']} inside the band (target >= {TARGET_IN_BAND})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default=DEFAULT_SET, choices=sorted(SETS), help="which held-out set")
    parser.add_argument("--rounds", type=int, default=1, help="runs of every job; figures are medians over rounds")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the runs (negative needs root)")
    parser.add_argument("--reuse", action="store_true", help="read the logs of earlier runs instead of running")
    parser.add_argument("--run-only", action="store_true", help="run the jobs and stop: measure and predict later "
                        "(--reuse), once the cost model to be checked is in place")
    parser.add_argument("--profiles", default="", help="predict as profiled plans, with each model's profile measured "
                        "once into DIR/profiles")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from restage.demo import ensure_tiny_model

    ensure_tiny_model()
    _, jobs, _, experiment = SETS[args.set]
    started, rows = time.time(), []
    runs: dict[str, list[dict]] = {name: [] for name in jobs}
    for k in range(args.rounds):
        for name, (model, layouts, ranks) in jobs.items():
            trial = f"{name}-r{k}"
            if not args.reuse:
                ensure_job_model(model)
                run_job(trial, size_of(name, args.set), layouts, args.steps, args.nice, ranks=ranks,
                        experiment=experiment)
                print(f"cpu_unprofiled: ran {trial} ({time.time() - started:.0f} s, load average "
                      f"{os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
            if not args.run_only:
                runs[name].append(measure(ROOT / "results" / experiment / trial, args.warmup))
    if args.run_only:
        return 0
    if args.profiles:
        directory = Path(args.profiles).resolve()
        for model in sorted({model for model, _, _ in jobs.values()}):
            ensure_profile(model, directory)
            print(f"cpu_unprofiled: profile of {model} ready", file=sys.stderr, flush=True)
        os.environ["RESTAGE_CLUSTER_DIR"] = str(directory)
    for name, got in runs.items():
        measured = {**got[0], "iteration_seconds": statistics.median(g["iteration_seconds"] for g in got),
                    "mfc_seconds": {m: statistics.median(g["mfc_seconds"][m] for g in got) for m in MFCS}}
        rows.append(score(name, measured))
    result = {"set": args.set, "jobs": rows, "summary": summarise(rows), "rounds": args.rounds,
              "load_average_after": os.getloadavg()}
    print(json.dumps(result, indent=1) if args.json else render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
