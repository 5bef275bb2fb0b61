"""The CPU roofline's fitted terms, from measured block profiles of the models the first CPU held-out set ran.

    python bench/cpu_roofline_fit.py [--cluster local-cpu] [--profiles DIR] [--json]

The roofline of a CPU rank (``restage.plan.compute.RooflineCompute``) missed the first held-out set of
``bench/cpu_unprofiled.py`` (``--set 2026-11-28``, predicted once by 781df7b): it put every MFC 15-60% under its
measured time. Those ten models' profiles (``restage profile``, one thread, round-robin timing: measured for
``--profiles`` and committed in ``bench/fit_profiles/``) and the calibration's tiny model's profile
(cluster/profiles) show where: the roofline's block forward, backward, prefill and decoding step at tp 1 were 0.73,
0.76, 0.69 and 0.44 of their measured times. What it left out, each a CPU cluster field:

* ``gemm_half_rows`` (measured, ``bench/cpu_rates.py``): a CPU BLAS GEMM of few rows runs below its square-GEMM
  rate (one thread on this machine: 24, 40, 58, 74, 87 and 99 GFLOP/s at 1, 4, 8, 16, 32 and 128 rows of a 512-wide
  weight; 101 at 1024);
* ``weight_read_bytes_per_second`` (measured, ``bench/cpu_rates.py``): the GEMM reads (packs) a cold weight matrix
  before computing, an added time whatever its rows; a decoding step of few rows is mostly this read and per-call
  costs;
* ``block_overhead_seconds`` and ``compute_efficiency``, fitted here with the two above set: the per-block host time
  of an eager block (Python, dispatcher, the 36 non-GEMM ops) and the in-model GEMM rate (F.linear on transposed
  weights, and the elementwise and attention work the roofline counts only as bytes).

Fitting all four on the profiles alone was tried first and is not identifiable: the rows term and the weight read
both penalise small batches, and the two halves' fits differed by 120-200% in them; measured apart, they leave two
constants to fit. Fitted by grid search (``GRID``) for the least mean |log(predicted / measured)| over every tp-1
block entry of the profiles (``FIT_PROFILES_DIR`` and ``TINY_PROFILE``; forward, backward, prefill, decoding step;
batch 1-32, 8-64 tokens). ``stability`` fits the two disjoint halves of the models (alternate widths) alone: each
constant's relative spread between them. tp-2 entries are scored, not fitted (a one-process TP group in the
profiler). The fresh held-out set (``bench/cpu_unprofiled.py --set 2026-11-29``) was committed (49fad0f) before this
fit and before any of its jobs was predicted.

On another machine, measure the rates first (``bench/cpu_rates.py``), then profile the same models there (``restage
profile --model results/assets/cpu-unprofiled-<model>`` with ``bench/cpu_unprofiled.py``'s ``PROFILE_GRID``, the
models built by its ``ensure_job_model``) into a directory and fit on it with ``--profiles DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
from pathlib import Path

from restage.cluster import ClusterSpec, load_cluster
from restage.models.arch import ModelConfig
from restage.plan.compute import RooflineCompute

ROOT = Path(__file__).resolve().parents[1]
FIT_PROFILES_DIR = ROOT / "bench" / "fit_profiles"
TINY_PROFILE = ROOT / "cluster" / "profiles" / "local-cpu--tiny-llama--fp32.json"
# profile op: the roofline's method for it
OPS = {"block_forward": "block_forward", "block_backward": "block_backward", "prefill": "block_prefill",
       "decode_step": "decode_block"}
GRID = {"block_overhead_seconds": tuple(k * 2.5e-5 for k in range(8, 41)),  # 0.2-1.0 ms
        "compute_efficiency": tuple(k / 100 for k in range(50, 91))}


def load_profiles(paths: list[Path]) -> list[tuple[str, ModelConfig, list[dict]]]:
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        out.append((path.name, ModelConfig.from_json(data["arch"]), data["entries"]))
    return out


def log_errors(cluster: ClusterSpec, profiles, tp: int = 1) -> dict[str, list[float]]:
    """log(roofline / measured) of every block entry at ``tp``, per op."""
    out: dict[str, list[float]] = {op: [] for op in OPS}
    for _, cfg, entries in profiles:
        roofline = RooflineCompute(cluster, cfg, "fp32")
        for e in entries:
            if e["op"] in OPS and e["tp"] == tp:
                predicted = getattr(roofline, OPS[e["op"]])(e["batch"], e["seq"], tp)
                out[e["op"]].append(math.log(predicted / e["seconds"]))
    return out


def median_abs(errors: dict[str, list[float]]) -> float:
    return statistics.median(abs(x) for v in errors.values() for x in v)


def mean_abs(errors: dict[str, list[float]]) -> float:
    return statistics.fmean(abs(x) for v in errors.values() for x in v)


def summary(errors: dict[str, list[float]]) -> dict:
    return {"median_abs_log_error": median_abs(errors),
            "median_ratio_per_op": {op: math.exp(statistics.median(v)) for op, v in errors.items() if v}}


def fit(base: ClusterSpec, profiles) -> dict[str, float]:
    """The grid point with the least median |log error| over ``profiles``' tp-1 block entries."""
    best: tuple[float, dict[str, float]] | None = None
    names = list(GRID)
    for values in itertools.product(*GRID.values()):
        constants = dict(zip(names, values))
        score = mean_abs(log_errors(dataclasses.replace(base, **constants), profiles))
        if best is None or score < best[0]:
            best = (score, constants)
    assert best is not None
    return best[1]


def stability(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Each constant's spread between two fits, over their mean (0 where both are 0)."""
    return {k: (abs(a[k] - b[k]) / ((a[k] + b[k]) / 2) if a[k] + b[k] else 0.0) for k in a}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="local-cpu")
    parser.add_argument("--profiles", default=str(FIT_PROFILES_DIR), help="directory of the models' block profiles "
                        "(the calibration's tiny model's is added from cluster/profiles)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    base = load_cluster(args.cluster)
    profiles = load_profiles(sorted(Path(args.profiles).glob("*.json")) + [TINY_PROFILE])
    off = dataclasses.replace(base, gemm_half_rows=0, weight_read_bytes_per_second=0, block_overhead_seconds=3.5e-4,
                              compute_efficiency=0.834)  # the file before these terms (781df7b)
    print(f"cpu_roofline_fit: {len(profiles)} profiles; fitting all, then each half", file=sys.stderr, flush=True)
    constants = fit(base, profiles)
    by_width = sorted(profiles, key=lambda p: p[1].hidden_size)
    halves = [fit(base, by_width[0::2]), fit(base, by_width[1::2])]
    fitted = dataclasses.replace(base, **constants)
    result = {
        "cluster": args.cluster, "profiles": [name for name, _, _ in profiles], "constants": constants,
        "in_file": {k: getattr(base, k) for k in constants},
        "fit_tp1": summary(log_errors(fitted, profiles)), "fit_tp2": summary(log_errors(fitted, profiles, tp=2)),
        "without_terms_tp1": summary(log_errors(off, profiles)),
        "per_model_tp1": {name: summary(log_errors(fitted, [(name, cfg, e)]))["median_ratio_per_op"]
                          for name, cfg, e in profiles},
        "halves": halves, "stability": stability(*halves)}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print("fitted: " + ", ".join(f"{k} {v:g} (file {result['in_file'][k]:g})" for k, v in constants.items()))
    for key in ("without_terms_tp1", "fit_tp1", "fit_tp2"):
        s = result[key]
        print(f"{key:<18} median |log error| {s['median_abs_log_error']:.3f}; roofline/measured per op "
              + ", ".join(f"{op} {r:.2f}" for op, r in s["median_ratio_per_op"].items()))
    print("halves: " + " | ".join(", ".join(f"{k} {v:g}" for k, v in h.items()) for h in halves))
    print("stability (spread between the halves' fits): "
          + ", ".join(f"{k} {v:.0%}" for k, v in result["stability"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
