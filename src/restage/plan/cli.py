"""``restage plan CONFIG [key=value ...]``: choose an execution plan, print it, write schedule.json."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from restage.accuracy import Band, ProcessBaseline
from restage.accuracy import accuracy_of as band_and_baseline
from restage.cluster import device_is_gpu, load_cluster
from restage.config.load import load_config
from restage.plan.peers.baselines import BASELINES, LABELS
from restage.plan.peers.behind import behind_line
from restage.plan.planner import GIB, PlanOutcome, make_plan
from restage.plan.schedule import build_schedule
from restage.schedule.execution import Async
from restage.schedule.file import Schedule, write_schedule
from restage.schedule.ops import Realloc
from restage.schedule.predictions import ModeChoice


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (e.g. run.batch_size=64)")
    parser.add_argument("--out", help="schedule path (default results/<experiment>/<trial>/schedule.json)")
    parser.add_argument("--cluster", help="cluster name or YAML file (default: the config's cluster.name)")
    parser.add_argument("--nodes", type=int, help="node count (default: the config's cluster.nodes)")
    parser.add_argument("--search-seconds", type=float, help="search time budget (default plan.time_budget_seconds)")
    parser.add_argument("--seed", type=int, help="search seed (default: the config's seed)")
    parser.add_argument("--json", action="store_true", help="print the schedule's summary as JSON")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    cluster = None
    if args.cluster or args.nodes:
        ref = cfg.cluster
        cluster = load_cluster(args.cluster or ref.name, args.nodes or ref.nodes, ref.devices_per_node or None)
    started = time.perf_counter()
    outcome = make_plan(cfg, cluster, seed=args.seed, time_budget_seconds=args.search_seconds)
    schedule = build_schedule(cfg, outcome)
    path = write_schedule(schedule, args.out or cfg.trial_dir / "schedule.json")
    wall = time.perf_counter() - started
    if args.json:
        print(json.dumps(summary(schedule, outcome) | {"schedule": str(path), "plan_wall_seconds": wall}, indent=1))
    else:
        print(render(schedule, outcome))
        print(f"schedule written to {path} ({wall:.1f} s)")
    return 0


def accuracy_of(schedule: Schedule) -> tuple[Band, ProcessBaseline]:
    """The uncertainty band and process baseline (restage/accuracy.py) for the schedule's cluster, the band of profiled
    plans where every estimate came from a measured profile."""
    return band_and_baseline(device_is_gpu(schedule.cluster.device), schedule.predicted.estimator)


def summary(schedule: Schedule, outcome: PlanOutcome) -> dict[str, Any]:
    p = schedule.predicted
    band, baseline = accuracy_of(schedule)
    return {"experiment": schedule.experiment, "cluster": schedule.cluster.name, "world_size": schedule.world_size,
            "mode": outcome.mode, "iteration_seconds": p.iteration_seconds,
            "iteration_band_seconds": list(band.seconds(p.iteration_seconds)),
            "band": {"low_ratio": band.low_ratio, "high_ratio": band.high_ratio, "points": band.points,
                     "what": band.what, "source": band.source},
            "peak_memory_bytes": p.peak_memory_bytes, "process_baseline_bytes": baseline.bytes,
            "process_baseline": {"what": baseline.what, "source": baseline.source},
            "samples_per_second": p.samples_per_second,
            "pflops_per_second": p.pflops_per_second, "estimator": list(p.estimator),
            "execution": outcome.mode_choice.to_json() if outcome.mode_choice is not None else None,
            "mfcs": [{"name": m.mfc.name, "layout": m.layout.to_json(), "micro_batches": m.mfc.micro_batches,
                      **m.predicted.to_json()} for m in schedule.mfcs],
            "baselines": {name: (None if ev is None else {"iteration_seconds": ev.iteration_seconds,
                                                          "speedup": ev.iteration_seconds / p.iteration_seconds})
                          for name, ev in outcome.baselines.items()}}


def render(schedule: Schedule, outcome: PlanOutcome) -> str:
    c, p = schedule.cluster, schedule.predicted
    ep_head = f" {'ep':>3}" if any(m.layout.strategy.ep > 1 for m in schedule.mfcs) else ""  # mixtures split over ep
    lines = [f"{schedule.experiment}: {c.nodes} node(s) x {c.devices_per_node} {c.name}, plan mode {outcome.mode}, "
             f"estimator {', '.join(p.estimator)}",
             f"{'MFC':<20} {'mesh':<10} {'dp':>3} {'tp':>3} {'pp':>3}{ep_head} {'mb':>4} {'seconds':>9} {'start':>8} "
             f"{'plan GiB':>9}"]
    for m in schedule.mfcs:
        mesh, s, pr = list(m.layout.mesh), m.layout.strategy, m.predicted
        ranks = f"{mesh[0]}-{mesh[-1]}" if mesh == list(range(mesh[0], mesh[-1] + 1)) else ",".join(map(str, mesh))
        ep = f" {s.ep:>3}" if ep_head else ""
        lines.append(f"{m.mfc.name:<20} {ranks:<10} {s.dp:>3} {s.tp:>3} {s.pp:>3}{ep} "
                     f"{m.mfc.micro_batches:>4} {pr.seconds:>9.3f} {pr.start_seconds:>8.3f} "
                     f"{pr.peak_memory_bytes / GIB:>9.2f}")
    for step in schedule.steps:
        if isinstance(step.op, Realloc) and step.bytes is not None and step.predicted is not None:
            dst, d = step.op.dst, step.op.dst.strategy
            lines.append(f"  realloc {step.op.model} to [{dst.mesh[0]}-{dst.mesh[-1]}]dp{d.dp}tp{d.tp}"
                         f"pp{d.pp}: {step.bytes / GIB:.2f} GiB moved, {step.predicted.seconds:.3f} s")
    if outcome.mode_choice is not None:
        lines.append(mode_line(outcome.mode_choice))
    elif isinstance(schedule.execution, Async):
        lines.append(async_line(schedule.execution))
    band, baseline = accuracy_of(schedule)
    low, high = band.seconds(p.iteration_seconds)
    lines.append(f"iteration {p.iteration_seconds:.3f} s (likely {low:.3f}-{high:.3f} s), "
                 f"{p.samples_per_second:.2f} samples/s, {p.pflops_per_second:.3f} PFLOP/s, peak "
                 f"{p.peak_memory_bytes / GIB:.2f} of {p.usable_memory_bytes / GIB:.1f} GiB planned "
                 f"+ {baseline.bytes / GIB:.2f} GiB process baseline per rank")
    lines.append(f"  likely: {band.describe()}; process baseline: {baseline.label} (sources: restage/accuracy.py)")

    for group, title in ((True, "baselines (peer systems' default plans)"),
                         (False, "reference points (restricted searches with restage's estimator, not baselines)")):
        shown = [(name, ev) for name, ev in outcome.baselines.items() if (name in BASELINES) == group]
        if shown:
            lines.append(f"{title}:")
        for name, ev in shown:
            what = f"{name} ({LABELS.get(name, name)})"
            if ev is None:
                lines.append(f"  vs {what}: no plan that fits")
            else:
                lines.append(f"  vs {what}: {ev.iteration_seconds:.3f} s, this plan is "
                             f"{ev.iteration_seconds / p.iteration_seconds:.2f}x as fast")
                if group and (behind := behind_line(outcome, name, ev)):
                    lines.append(behind)  # a peer ahead: which MFC, and what bears on it (plan/peers/behind.py)
    return "\n".join(lines)


def async_line(execution: Async) -> str:
    """plan.execution async: the staleness bound, the push interval and whether answers continue across pushes."""
    partial = ", partial rollouts" if execution.partial else ""
    return f"execution: async (staleness {execution.staleness}, push every {execution.push_every}{partial})"


def mode_line(choice: ModeChoice) -> str:
    """plan.execution auto: the chosen mode beside the best synchronous plan, both predicted samples/s."""
    sync = f"{choice.sync_samples_per_second:.2f}" if choice.sync_samples_per_second else "none"
    if choice.async_samples_per_second is None:
        return f"execution: sync chosen ({sync} samples/s predicted); no asynchronous plan fits"
    rate = f"{choice.async_samples_per_second:.2f} samples/s"
    ratio = (f", {choice.async_samples_per_second / choice.sync_samples_per_second:.2f}x"
             if choice.sync_samples_per_second else "")
    partial = ", partial rollouts" if choice.partial else ""
    return (f"execution: {choice.chosen} chosen; best async plan (staleness {choice.staleness}, push every "
            f"{choice.push_every}{partial}) {rate}{ratio}; best synchronous plan {sync} samples/s (predicted)")
