"""A run's report as one JSON-ready dict (``summarize``) and the same numbers as a text table (``format_text``)."""

from __future__ import annotations

import math

import numpy as np

from restage.accuracy import Band, ProcessBaseline
from restage.errors import LogError
from restage.report.log import RunLog
from restage.report.throughput import (
    accuracy_for,
    mfc_table,
    movement_totals,
    peak_flops_per_device,
    predictions_from_schedule,
    rank_shares,
    run_dtype,
    step_flops,
    throughput,
)

GIB = 2**30


def status_line(log: RunLog) -> str:
    """Whether the run closed its log, or up to which step a crashed (or running) run's log is reported."""
    if log.closed:
        return f"complete: the run closed its log after step {log.last_complete_step}"
    dropped = f"; {log.dropped_rows} rows of the step in flight dropped" if log.dropped_rows else ""
    return (f"log not closed (the run crashed or is still running): reported up to its last complete step "
            f"{log.last_complete_step}{dropped}")


def _stat_summary(log: RunLog, last_n: int) -> dict[str, dict]:
    out = {}
    for name, (steps, values) in log.stat_series().items():
        out[name] = {"count": len(values), "first_step": int(steps[0]), "last": float(values[-1]),
                     "mean": float(values.mean()), f"mean_last_{last_n}": float(values[-last_n:].mean()),
                     "min": float(values.min()), "max": float(values.max())}
    return out


def summarize(log: RunLog, last_n: int = 20) -> dict:
    """Every number of the report. ``last_n``: the window of the recent-throughput column."""
    if len(log.steps) == 0:
        raise LogError(f"{log.path} has no complete step; the run stopped before finishing its first step")
    if last_n < 1:
        raise LogError(f"--last {last_n}: give a positive number of steps")
    order = np.argsort(log.steps["step"], kind="stable")
    rows, flops = log.steps[order], step_flops(log)[order]
    cluster = log.cluster or (log.schedule or {}).get("cluster")  # the schedule carries the cluster too
    peak, dtype_or_reason = peak_flops_per_device(cluster, run_dtype(log))
    overall = throughput(log, rows, flops, peak)
    shares, warnings = rank_shares(log, overall["wall_seconds"])
    predictions = predictions_from_schedule(log.schedule)
    if not predictions:
        warnings.append("the schedule carries no per-MFC predictions; predicted against measured is skipped")
    if peak is None:
        warnings.append(f"MFU skipped: {dtype_or_reason}")
    accuracy = accuracy_for(cluster, log.schedule)
    memory_note = "" if accuracy else "the log names no device, so no process baseline or band is known"
    mfcs = mfc_table(log, predictions, accuracy)
    if predictions and not memory_note and not any(m["memory_compared"] for m in mfcs):
        memory_note = "the schedule predicts no peak memory for these MFCs"
    if memory_note:
        warnings.append(f"peak memory is shown measured only: {memory_note}")
    iteration = iteration_check(log.schedule, float(np.median(rows["end_seconds"] - rows["start_seconds"])), accuracy)
    return {
        "log": str(log.path), "format_version": log.format_version, "world_size": log.world_size,
        "closed": log.closed, "crashed": log.crashed, "status": status_line(log),
        "last_complete_step": log.last_complete_step, "resumed_at_steps": log.resumed_at_steps,
        "peak_flops_per_device": peak, "mfu_dtype": dtype_or_reason if peak is not None else None,
        "throughput": {"all": overall, "last": throughput(log, rows[-last_n:], flops[-last_n:], peak)},
        "last_n": last_n,
        "iteration": iteration, "mfcs": mfcs, "memory_note": memory_note,
        "process_baseline": None if accuracy is None else {"bytes": accuracy[1].bytes, "label": accuracy[1].label,
                                                           "what": accuracy[1].what,
                                                           "source": accuracy[1].source},
        "movements": movement_totals(log, overall["wall_seconds"]),
        "shares": {str(rank): entry for rank, entry in sorted(shares.items())},
        "stats": _stat_summary(log, last_n),
        "warnings": warnings,
    }


def iteration_check(schedule: dict | None, measured_seconds: float, accuracy: tuple[Band, ProcessBaseline] | None) -> dict:
    """The median step time against the schedule's predicted iteration time and its band (what ``restage plan`` printed)."""
    predicted = ((schedule or {}).get("predicted") or {}).get("iteration_seconds")
    out: dict = {"measured_seconds": measured_seconds, "predicted_seconds": predicted, "band_seconds": None,
                 "inside_band": None, "error_percent": None, "band": None}
    if predicted is None:
        return out
    out["error_percent"] = 100.0 * (predicted - measured_seconds) / measured_seconds if measured_seconds > 0 else None
    if accuracy is not None:
        band = accuracy[0]
        low, high = band.seconds(float(predicted))
        out.update(band_seconds=[low, high], inside_band=low <= measured_seconds <= high,
                   band={"low_ratio": band.low_ratio, "high_ratio": band.high_ratio, "points": band.points,
                         "what": band.what, "source": band.source})
    return out


def json_ready(value):
    """NaN and infinities become null, so the output is strict JSON."""
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)


def fmt_number(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _scaled(value, factor: float):
    return None if value is None else value * factor


def text_table(header: list[str], rows: list[list[str]], indent: str = "  ", left: tuple[int, ...] = (0,)) -> list[str]:
    """Columns separated by two spaces; the ``left`` columns left-aligned, numbers right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    left = tuple(i % len(header) for i in left)

    def line(cells):
        return indent + "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [line(header)] + [line(r) for r in rows]


def format_text(summary: dict) -> str:
    """The report as text: the same numbers as the JSON, rounded for reading."""
    out = [f"restage report: {summary['log']}", f"status: {summary['status']}"]
    alls, last = summary["throughput"]["all"], summary["throughput"]["last"]
    out.append(f"steps {alls['first_step']}..{alls['last_step']} ({alls['steps']} complete), world size "
               f"{summary['world_size']}, log format {summary['format_version']}"
               + (f", resumed at steps {summary['resumed_at_steps']}" if summary["resumed_at_steps"] else ""))
    mfu_label = "MFU"
    if summary["peak_flops_per_device"]:
        mfu_label = f"MFU ({summary['mfu_dtype']}, peak {summary['peak_flops_per_device'] / 1e12:.1f} TFLOP/s)"
    rows = [["steps", str(alls["steps"]), str(last["steps"])]]
    for label, key, fmt in (("wall seconds", "wall_seconds", ".3f"), ("samples/s", "samples_per_second", ".4f"),
                            ("tokens/s", "tokens_per_second", ".2f"), ("TFLOP/s per device", "tflops_per_device", ".4f"),
                            ("step seconds (mean)", "step_seconds_mean", ".4f")):
        rows.append([label, fmt_number(alls[key], fmt), fmt_number(last[key], fmt)])
    rows.append([mfu_label, fmt_number(_scaled(alls["mfu"], 100), ".3f") + "%",
                 fmt_number(_scaled(last["mfu"], 100), ".3f") + "%"])
    out += ["", "throughput"] + text_table(["", "all steps", f"last {summary['last_n']}"], rows)

    it = summary["iteration"]
    if it["predicted_seconds"] is not None:
        line = (f"iteration: measured {it['measured_seconds']:.4f} s (median step), predicted {it['predicted_seconds']:.4f} s"
                f" ({fmt_number(it['error_percent'], '+.1f')}%)")
        if it["band_seconds"]:
            low, high = it["band_seconds"]
            line += (f", likely {low:.4f}-{high:.4f} s: {'inside' if it['inside_band'] else 'OUTSIDE'} the band "
                     f"(x{it['band']['low_ratio']:.2f}..x{it['band']['high_ratio']:.2f}, {it['band']['what']})")
        out += ["", line]

    rows = []
    for m in summary["mfcs"]:
        band = m["predicted_band_seconds"]
        rows.append([m["name"], m["model"], m["kind"], ranks_text(m["ranks"]), fmt_number(m["measured_seconds"], ".4f"),
                     fmt_number(m["predicted_seconds"], ".4f"), fmt_number(m["error_percent"], "+.1f"),
                     "-" if band is None else f"{band[0]:.4f}-{band[1]:.4f}" + ("" if m["inside_band"] else " out"),
                     fmt_number(m["peak_memory_bytes"] / GIB, ".2f"),
                     fmt_number(_scaled(m["predicted_peak_memory_bytes"] if m["memory_compared"] else None, 1 / GIB),
                                ".2f"),
                     fmt_number(m["memory_error_percent"], "+.1f")])
    out += ["", "MFCs (measured: median over steps of the span over its ranks; error: predicted vs measured)"]
    out += text_table(["mfc", "model", "kind", "ranks", "measured s", "predicted s", "error %", "likely s", "peak mem GiB",
                   "pred mem GiB", "mem error %"], rows)
    if summary["process_baseline"] and any(m["memory_compared"] for m in summary["mfcs"]):
        out.append(f"pred mem GiB: the plan's bytes + a process baseline of {summary['process_baseline']['bytes'] / GIB:.2f} "
                   f"GiB per rank ({summary['process_baseline']['label']}; restage/accuracy.py)")

    rows = [[kind, str(v["count"]), fmt_number(100 * v["share"], ".3f"), fmt_number(v["seconds_per_step"], ".4f"),
             fmt_number(v["bytes_per_step"] / 1e9, ".4f")] for kind, v in summary["movements"].items()]
    out += ["", "reallocations and data transfers (share: of wall time, any in flight)"]
    out += text_table(["kind", "rows", "share %", "s/step", "GB/step"], rows)

    names = [m["name"] for m in summary["mfcs"]]
    rows = [[rank, *(fmt_number(100 * s["mfcs"].get(n, 0.0), ".2f") for n in names), fmt_number(100 * s["realloc"], ".2f"),
             fmt_number(100 * s["transfer"], ".2f"), fmt_number(100 * s["total"], ".2f"), fmt_number(100 * s["idle"], ".2f")]
            for rank, s in summary["shares"].items()]
    out += ["", "time share per rank (% of wall time)"]
    out += text_table(["rank", *names, "realloc", "transfer", "total", "idle"], rows)

    if summary["stats"]:
        key = f"mean_last_{summary['last_n']}"
        rows = [[name, str(s["count"]), fmt_number(s["last"], ".5g"), fmt_number(s["mean"], ".5g"), fmt_number(s[key], ".5g"),
                 fmt_number(s["min"], ".5g"), fmt_number(s["max"], ".5g")] for name, s in summary["stats"].items()]
        header = ["name", "steps", "last", "mean", f"mean last {summary['last_n']}", "min", "max"]
        out += ["", "statistics"] + text_table(header, rows)
    if summary["warnings"]:
        out += [""] + [f"warning: {w}" for w in summary["warnings"]]
    return "\n".join(out)
