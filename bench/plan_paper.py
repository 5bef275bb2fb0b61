"""Estimated throughput of the searched plan against peers' default plans and restricted searches, per jobs/paper/ config.

    python bench/plan_paper.py [--json] [--search-seconds S] [--only SUBSTRING] [--flash-attn auto|yes|no]

Two groups are compared with the searched plan (restage.plan.peers.baselines):

* baselines: the plans DeepSpeed-Chat, OpenRLHF, NeMo-Aligner and verl produce by their documented
  default rules (restage.plan.peers.defaults), scored by restage's estimator;
* reference points: restricted searches (the best single colocated strategy, the best split into
  halves, ...), enumerated with restage's own estimator: not heuristics anyone runs.

All configs run in one process (the estimator's caches are per problem). Figures are
predictions of restage's estimator and simulator, not measurements. The search runs twice with the
same budget: seeded with every plan of both groups that restage's runtime can run (re-estimated
with the config's memory settings; ``search``), and from a cold start, seeded with no baseline or
reference plan (``cold_search``, its speedups in ``cold_speedup_vs_best_*``).

``--flash-attn``: whether restage's rollout engine is costed with flash-attn installed on the ranks (its paged
decode kernel and 256-token blocks, ``plan/generation_cost.py``), ``auto`` (the default) as in this process; the peers'
engines are costed the same either way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from restage.config.load import load_config
from restage.errors import PlanError
from restage.plan.peers.baselines import BASELINES, LABELS, REFERENCES, all_baselines, all_references, starting_plans
from restage.plan.planner import build_problem, check_fits
from restage.plan.search import search

ROOT = Path(__file__).resolve().parents[1]
FLASH_CHOICES = {"auto": None, "yes": True, "no": False}  # --flash-attn: planner.engine_of's flash_attn


def throughput(problem, seconds: float) -> dict:
    return {"iteration_seconds": seconds, "samples_per_second": problem.samples_per_iteration / seconds,
            "pflops_per_second": problem.iteration_flops() / seconds / 1e15}


def run_config(path: Path, search_seconds: float, seed: int, flash_attn: bool | None = None) -> dict:
    cfg = load_config(path)
    problem = build_problem(cfg, flash_attn=flash_attn)
    row = {"config": path.stem, "cluster": problem.cluster.name, "devices": problem.cluster.world_size,
           "flash_attn": problem.estimator.engine.flash_attn}
    started = time.perf_counter()
    try:
        check_fits(problem)
    except PlanError as err:
        return row | {"refused": str(err)}
    peers = all_baselines(problem)
    references = all_references(problem)
    baseline_seconds = time.perf_counter() - started
    result = search(problem, seed=seed, time_budget_seconds=search_seconds, initial=starting_plans(problem, peers | references))
    cold = search(problem, seed=seed, time_budget_seconds=search_seconds)
    searched = result.evaluation.iteration_seconds
    for key, got in (("search", result), ("cold_search", cold)):
        row[key] = throughput(problem, got.evaluation.iteration_seconds) | {
            "wall_seconds": got.wall_seconds, "steps": got.steps, "method": got.method,
            "plan": [f"{c.mfc}={c}" for c in got.best]}
    row["baseline_wall_seconds"] = baseline_seconds
    for key, found in (("baselines", peers), ("references", references)):
        row[key] = {name: (throughput(problem, got[1].iteration_seconds) | {"plan": [f"{c.mfc}={c}" for c in got[0]]}
                           if got else None) for name, got in found.items()}
        fitting = [b["iteration_seconds"] for b in row[key].values() if b]
        row[f"speedup_vs_best_{key[:-1]}"] = min(fitting) / searched if fitting else None
        row[f"cold_speedup_vs_best_{key[:-1]}"] = (min(fitting) / row["cold_search"]["iteration_seconds"]
                                                   if fitting else None)
    row["never_worse"] = all(searched <= b["iteration_seconds"] * (1 + 1e-9)
                             for key in ("baselines", "references") for b in row[key].values() if b)
    return row


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--search-seconds", type=float, default=10.0, help="search time budget per config")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", default="", help="run only configs whose name contains this")
    parser.add_argument("--flash-attn", choices=FLASH_CHOICES, default="auto",
                        help="cost restage's rollout engine with flash-attn installed on the ranks (auto: as here)")
    args = parser.parse_args(argv)
    flash_attn = FLASH_CHOICES[args.flash_attn]
    paths = sorted(p for p in (ROOT / "jobs" / "paper").glob("*.yaml") if args.only in p.stem)
    rows = []
    for path in paths:
        rows.append(run_config(path, args.search_seconds, args.seed, flash_attn))
        if not args.json:
            print(render(rows[-1]), flush=True)
    summary = {"configs": len(rows), "planned": sum("search" in r for r in rows),
               "never_worse_than_any_baseline_or_reference": all(r["never_worse"] for r in rows if "search" in r),
               "max_search_wall_seconds": max((r["search"]["wall_seconds"] for r in rows if "search" in r), default=None),
               "max_total_wall_seconds": max((r["search"]["wall_seconds"] + r["baseline_wall_seconds"]
                                              for r in rows if "search" in r), default=None),
               "max_cold_search_wall_seconds": max((r["cold_search"]["wall_seconds"] for r in rows if "search" in r),
                                                   default=None)}
    for key, names in (("baseline", BASELINES), ("reference", REFERENCES)):
        ratios = [r[f"speedup_vs_best_{key}"] for r in rows if r.get(f"speedup_vs_best_{key}")]
        cold = [r[f"cold_speedup_vs_best_{key}"] for r in rows if r.get(f"cold_speedup_vs_best_{key}")]
        summary[f"{key}s"] = {
            "configs_with_one_that_fits": len(ratios),
            "mean_speedup_vs_best": _mean(ratios),
            "cold_start_mean_speedup_vs_best": _mean(cold),
            "geomean_speedup_vs_best": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
            "mean_speedup_vs": {name: _mean([r[f"{key}s"][name]["iteration_seconds"] / r["search"]["iteration_seconds"]
                                             for r in rows if "search" in r and r[f"{key}s"].get(name)]) for name in names},
            "configs_where_it_fits": {name: sum(1 for r in rows if "search" in r and r[f"{key}s"].get(name))
                                      for name in names}}
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary}, indent=1))
    else:
        print("\n" + render_summary(summary))
    return 0


def render(row: dict) -> str:
    head = f"{row['config']} ({row['devices']} x {row['cluster']})"
    if "refused" in row:
        return f"{head}: refused: {row['refused']}"
    s = row["search"]
    lines = [head, f"  {'plan':<16} {'iter s':>9} {'samples/s':>10} {'PFLOP/s':>8} {'search is':>10}",
             f"  {'search':<16} {s['iteration_seconds']:>9.2f} {s['samples_per_second']:>10.2f} {s['pflops_per_second']:>8.3f} "
             f"{'':>10}   ({s['method']}, {s['steps']} steps, {s['wall_seconds']:.1f} s; baselines and references "
             f"{row['baseline_wall_seconds']:.1f} s)"]
    c = row["cold_search"]
    lines.append(f"  {'cold search':<16} {c['iteration_seconds']:>9.2f} {c['samples_per_second']:>10.2f} "
                 f"{c['pflops_per_second']:>8.3f} {c['iteration_seconds'] / s['iteration_seconds']:>9.2f}x   (seeded with no "
                 f"baseline, {c['steps']} steps, {c['wall_seconds']:.1f} s)")
    for key, title in (("baselines", "baselines: peers' default plans"),
                       ("references", "reference points: restricted searches with restage's estimator")):
        lines.append(f"  {title}")
        for name, b in row[key].items():
            if b is None:
                lines.append(f"  {name:<16} {'no plan that fits':>29}   {LABELS[name]}")
            else:
                lines.append(f"  {name:<16} {b['iteration_seconds']:>9.2f} {b['samples_per_second']:>10.2f} "
                             f"{b['pflops_per_second']:>8.3f} {b['iteration_seconds'] / s['iteration_seconds']:>9.2f}x   "
                             f"{LABELS[name]}")
    lines.append(f"  searched plan: {' '.join(s['plan'])}")
    return "\n".join(lines)


def render_summary(summary: dict) -> str:
    lines = [f"{summary['planned']} of {summary['configs']} configs planned; searched plan never worse than any baseline "
             f"or reference point: {summary['never_worse_than_any_baseline_or_reference']}; longest search "
             f"{summary['max_search_wall_seconds']:.1f} s, longest search + baselines {summary['max_total_wall_seconds']:.1f} s"]
    for key, title in (("baselines", "peers' default plans (baselines)"), ("references", "restricted searches (reference points)")):
        g = summary[key]
        if g["mean_speedup_vs_best"] is None:
            lines.append(f"vs {title}: none fits anywhere")
            continue
        lines.append(f"vs the best of the {title}: {g['mean_speedup_vs_best']:.3f}x on average (geometric mean "
                     f"{g['geomean_speedup_vs_best']:.3f}x) over the {g['configs_with_one_that_fits']} configs where one fits; "
                     f"from a cold start {g['cold_start_mean_speedup_vs_best']:.3f}x")
        lines.append("  per plan (mean over the configs where it fits): " + ", ".join(
            f"{name} {v:.3f}x ({g['configs_where_it_fits'][name]})" if v else f"{name} never fits"
            for name, v in g["mean_speedup_vs"].items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
