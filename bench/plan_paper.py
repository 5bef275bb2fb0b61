"""Estimated throughput of the searched plan against every baseline, for each config in jobs/paper/.

    python bench/plan_paper.py [--json] [--search-seconds S] [--only SUBSTRING]

All configs run in one process (the estimator's caches are per problem). Figures are
predictions of restage's estimator and simulator, not measurements. The search starts from the
baselines, so it can never end worse than them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from restage.config import load_config
from restage.errors import PlanError
from restage.plan.baselines import BASELINES, all_baselines
from restage.plan.planner import build_problem, check_fits
from restage.plan.search import search

ROOT = Path(__file__).resolve().parents[1]


def throughput(problem, seconds: float) -> dict:
    return {"iteration_seconds": seconds, "samples_per_second": problem.samples_per_iteration / seconds,
            "pflops_per_second": problem.iteration_flops() / seconds / 1e15}


def run_config(path: Path, search_seconds: float, seed: int) -> dict:
    cfg = load_config(path)
    problem = build_problem(cfg)
    row = {"config": path.stem, "cluster": problem.cluster.name, "devices": problem.cluster.world_size}
    started = time.perf_counter()
    try:
        check_fits(problem)
    except PlanError as err:
        return row | {"refused": str(err)}
    found = all_baselines(problem)
    baseline_seconds = time.perf_counter() - started
    result = search(problem, seed=seed, time_budget_seconds=search_seconds,
                    initial=[got[0] for got in found.values() if got is not None])
    row["search"] = throughput(problem, result.evaluation.iteration_seconds) | {
        "wall_seconds": result.wall_seconds, "steps": result.steps, "method": result.method,
        "plan": [f"{c.mfc}={c}" for c in result.best]}
    row["baseline_wall_seconds"] = baseline_seconds
    row["baselines"] = {name: (throughput(problem, got[1].iteration_seconds) if got else None) for name, got in found.items()}
    best = min(b["iteration_seconds"] for b in row["baselines"].values() if b)
    row["speedup_vs_best_baseline"] = best / result.evaluation.iteration_seconds
    row["never_worse"] = all(result.evaluation.iteration_seconds <= b["iteration_seconds"] * (1 + 1e-9)
                             for b in row["baselines"].values() if b)
    return row


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--search-seconds", type=float, default=10.0, help="search time budget per config")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default="", help="run only configs whose name contains this")
    args = parser.parse_args(argv)
    paths = sorted(p for p in (ROOT / "jobs" / "paper").glob("*.yaml") if args.only in p.stem)
    rows = []
    for path in paths:
        rows.append(run_config(path, args.search_seconds, args.seed))
        if not args.json:
            print(render(rows[-1]), flush=True)
    ratios = [r["speedup_vs_best_baseline"] for r in rows if "search" in r]
    summary = {"configs": len(rows), "planned": len(ratios),
               "mean_speedup_vs_best_baseline": sum(ratios) / len(ratios) if ratios else None,
               "geomean_speedup_vs_best_baseline": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
               "never_worse_than_any_baseline": all(r["never_worse"] for r in rows if "search" in r),
               "mean_speedup_vs": {name: _mean([r["baselines"][name]["iteration_seconds"] / r["search"]["iteration_seconds"]
                                                for r in rows if "search" in r and r["baselines"].get(name)])
                                   for name in BASELINES},
               "max_search_wall_seconds": max((r["search"]["wall_seconds"] for r in rows if "search" in r), default=None)}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print(f"\n{summary['planned']} configs planned: searched plan {summary['mean_speedup_vs_best_baseline']:.3f}x the "
              f"best baseline on average (geometric mean {summary['geomean_speedup_vs_best_baseline']:.3f}x), never worse "
              f"than any baseline: {summary['never_worse_than_any_baseline']}, longest search "
              f"{summary['max_search_wall_seconds']:.1f} s")
        print("mean speedup of the searched plan over each baseline: " + ", ".join(
            f"{name} {value:.3f}x" for name, value in summary["mean_speedup_vs"].items() if value))
    return 0


def render(row: dict) -> str:
    head = f"{row['config']} ({row['devices']} x {row['cluster']})"
    if "refused" in row:
        return f"{head}: refused: {row['refused']}"
    lines = [head, f"  {'plan':<14} {'iter s':>9} {'samples/s':>10} {'PFLOP/s':>8} {'vs search':>9}"]
    s = row["search"]
    lines.append(f"  {'search':<14} {s['iteration_seconds']:>9.2f} {s['samples_per_second']:>10.2f} "
                 f"{s['pflops_per_second']:>8.3f} {1.0:>9.2f}   ({s['method']}, {s['steps']} steps, "
                 f"{s['wall_seconds']:.1f} s; baselines {row['baseline_wall_seconds']:.1f} s)")
    for name in BASELINES:
        b = row["baselines"].get(name)
        if b is None:
            lines.append(f"  {name:<14} {'no plan that fits':>29}")
        else:
            lines.append(f"  {name:<14} {b['iteration_seconds']:>9.2f} {b['samples_per_second']:>10.2f} "
                         f"{b['pflops_per_second']:>8.3f} {b['iteration_seconds'] / s['iteration_seconds']:>8.2f}x")
    lines.append(f"  searched plan: {' '.join(s['plan'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
