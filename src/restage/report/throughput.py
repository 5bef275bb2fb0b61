"""The numbers of a report, each a plain function over the tables of a ``RunLog``.

Definitions (docs/report.md repeats them for users):

* wall seconds: the sum over steps of ``end_seconds - start_seconds`` of the step rows (gaps between
  steps, e.g. checkpoint saves, are not iteration time); samples/s and tokens/s divide the logged
  totals by it, TFLOP/s per device further divides by ``world_size``.
* step FLOPs: the step row's ``flops``; a log whose step rows carry none falls back to the sum of its
  MFC rows' FLOPs.
* a rank's share of an MFC: the sum of that MFC's durations on the rank over the wall seconds.
  Reallocation and transfer rows logged for one rank count for it; rows logged for the whole group
  (rank -1) count for every rank of their source and destination meshes.
* an MFC's measured seconds: the median over steps of its span (latest end minus earliest start over
  its ranks), the quantity the estimator predicts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from restage.accuracy import Band, ProcessBaseline, accuracy_of
from restage.cluster import device_is_gpu
from restage.report.log import RunLog


@dataclass(frozen=True)
class Prediction:
    """The estimator's prediction for one MFC, from the schedule."""

    seconds: float | None
    peak_memory_bytes: float | None


def predictions_from_schedule(schedule: dict | None) -> dict[str, Prediction]:
    """Per-MFC predictions, read from ``schedule["mfcs"][i]["name"]`` and ``["predicted"]["seconds"|"peak_memory_bytes"]``.

    Everything the report needs from the schedule's format is read here; a schedule without
    predictions gives an empty mapping and the report skips predicted against measured.
    """
    found: dict[str, Prediction] = {}
    for entry in (schedule or {}).get("mfcs", []) or []:
        predicted = entry.get("predicted") if isinstance(entry, dict) else None
        if not isinstance(predicted, dict) or "name" not in entry:
            continue
        seconds, memory = predicted.get("seconds"), predicted.get("peak_memory_bytes")
        found[str(entry["name"])] = Prediction(None if seconds is None else float(seconds),
                                               None if memory is None else float(memory))
    return found


def run_dtype(log: RunLog) -> str:
    """The dtype MFU is measured against: the log's ``dtype`` attribute, else the schedule's models' dtype if they agree."""
    if log.dtype:
        return log.dtype
    models = (log.schedule or {}).get("models") or {}
    dtypes: set[str] = {m["dtype"] for m in models.values() if isinstance(m, dict) and m.get("dtype")}
    return dtypes.pop() if len(dtypes) == 1 else ""


def peak_flops_per_device(cluster: dict | None, dtype: str) -> tuple[float | None, str]:
    """Peak FLOP/s of one device for ``dtype``, and the dtype used; (None, reason) when the cluster gives none.

    Reads ``cluster["peak_<dtype>_flops_per_second"]`` (``ClusterSpec.to_json()``), or
    ``cluster["device"]["peak_flops"][dtype]``. With no dtype known, bf16 is used if listed, else the only one.
    """
    cluster = cluster or {}
    table = {key[len("peak_"):-len("_flops_per_second")]: value for key, value in cluster.items()
             if key.startswith("peak_") and key.endswith("_flops_per_second")}
    device = cluster.get("device")
    if not table and isinstance(device, dict):
        table = device.get("peak_flops") or {}
    if not table:
        return None, "the log's cluster attribute has no peak FLOP/s per dtype"
    if not dtype:
        dtype = "bf16" if "bf16" in table else (next(iter(table)) if len(table) == 1 else "")
    if dtype not in table:
        return None, f"the cluster has no peak FLOP/s for {dtype or 'an unnamed dtype'} (it has {', '.join(sorted(table))})"
    return float(table[dtype]), dtype


def accuracy_for(cluster: dict | None, schedule: dict | None = None) -> tuple[Band, ProcessBaseline] | None:
    """The uncertainty band and process baseline (``restage/accuracy.py``) for the run's cluster, as ``restage plan``
    printed them (the profiled plans' band where the schedule's every estimate came from a profile); None when the
    log names no device.

    The runtime's peak memory is the whole rank's (on a GPU: allocated plus what lives outside the allocator; on a
    CPU: the peak resident set), so the prediction it is set against is the plan's bytes plus the process baseline.
    """
    device = (cluster or {}).get("device")
    if not isinstance(device, str) or not device:
        return None
    sources = ((schedule or {}).get("predicted") or {}).get("estimator") or ()
    return accuracy_of(device_is_gpu(device), sources)


_LAYOUT = re.compile(r"^\[([0-9,\- ]+)\]")


def layout_ranks(text: str) -> tuple[int, ...] | None:
    """Ranks of a layout written as ``str(Layout)``: ``[0-7]dp8tp1pp1`` or ``[0,2,4,6]dp4tp1pp1``; None if not."""
    match = _LAYOUT.match(text.strip())
    if not match:
        return None
    ranks: list[int] = []
    for part in match.group(1).split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        ranks.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(ranks)


def union_seconds(starts: np.ndarray, ends: np.ndarray) -> float:
    """Length of the union of the intervals ``[start, end]``."""
    if len(starts) == 0:
        return 0.0
    order = np.argsort(starts, kind="stable")
    total, cur_start, cur_end = 0.0, float(starts[order[0]]), float(ends[order[0]])
    for i in order[1:]:
        start, end = float(starts[i]), float(ends[i])
        if start > cur_end:
            total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + cur_end - cur_start


def step_flops(log: RunLog) -> np.ndarray:
    """FLOPs of each step row (step order of ``log.steps``), falling back to the sum of MFC rows."""
    flops = log.steps["flops"].astype(float)
    if flops.any() or len(log.mfcs) == 0:
        return flops
    index = {int(s): i for i, s in enumerate(log.steps["step"])}
    summed = np.zeros(len(log.steps))
    np.add.at(summed, [index[int(s)] for s in log.mfcs["step"]], log.mfcs["flops"])
    return summed


def throughput(log: RunLog, rows: np.ndarray, flops: np.ndarray, peak_flops: float | None) -> dict:
    """Totals and rates over a selection of step rows (and their FLOPs)."""
    wall = float((rows["end_seconds"] - rows["start_seconds"]).sum())
    samples, tokens, total_flops = int(rows["samples"].sum()), int(rows["tokens"].sum()), float(flops.sum())
    rate = (lambda x: x / wall) if wall > 0 else (lambda x: float("nan"))
    tflops = rate(total_flops) / max(1, log.world_size) / 1e12
    return {"steps": len(rows), "first_step": int(rows["step"].min()) if len(rows) else None,
            "last_step": int(rows["step"].max()) if len(rows) else None,
            "wall_seconds": wall, "samples": samples, "tokens": tokens, "flops": total_flops,
            "samples_per_second": rate(samples), "tokens_per_second": rate(tokens),
            "tflops_per_device": tflops, "mfu": (tflops * 1e12 / peak_flops) if peak_flops else None,
            "step_seconds_mean": wall / len(rows) if len(rows) else float("nan")}


def _transfer_ranks(log: RunLog) -> tuple[list[tuple[int, ...]], list[str]]:
    """For each transfer row, the ranks it occupies; plus warnings for rows whose layouts cannot be read."""
    ranks: list[tuple[int, ...]] = []
    warnings: list[str] = []
    for row in log.transfers:
        if row["rank"] >= 0:
            ranks.append((int(row["rank"]),))
            continue
        src, dst = layout_ranks(row["src"]), layout_ranks(row["dst"])
        if src is None or dst is None:
            warnings.append(f"{row['kind']} of {row['name']} at step {row['step']}: cannot read layouts "
                            f"{row['src']!r} -> {row['dst']!r}; not counted against any rank")
            ranks.append(())
        else:
            ranks.append(tuple(sorted(set(src) | set(dst))))
    return ranks, sorted(set(warnings))


def rank_shares(log: RunLog, wall_seconds: float) -> tuple[dict[int, dict], list[str]]:
    """Per rank: each MFC's share of the wall seconds, reallocation and transfer shares, their total and idle."""
    ranks = sorted(set(range(log.world_size)) | {int(r) for r in log.mfcs["rank"]})
    mfc_names = mfc_order(log)
    shares: dict[int, dict] = {r: {"mfcs": dict.fromkeys(mfc_names, 0.0), "realloc": 0.0, "transfer": 0.0} for r in ranks}
    if wall_seconds <= 0:
        return shares, ["no wall time logged; shares are zero"]
    durations = log.mfcs["end_seconds"] - log.mfcs["start_seconds"]
    for rank, name, seconds in zip(log.mfcs["rank"].tolist(), log.mfcs["name"].tolist(), durations.tolist()):
        shares[rank]["mfcs"][name] += seconds / wall_seconds
    transfer_ranks, warnings = _transfer_ranks(log)
    move_seconds = (log.transfers["end_seconds"] - log.transfers["start_seconds"]).tolist()
    for kind, seconds, occupied in zip(log.transfers["kind"].tolist(), move_seconds, transfer_ranks):
        for rank in occupied:
            shares.setdefault(rank, {"mfcs": dict.fromkeys(mfc_names, 0.0), "realloc": 0.0, "transfer": 0.0})
            shares[rank][kind] = shares[rank].get(kind, 0.0) + seconds / wall_seconds
    for rank, entry in shares.items():
        entry["total"] = sum(entry["mfcs"].values()) + entry["realloc"] + entry["transfer"]
        entry["idle"] = 1.0 - entry["total"]
        if entry["total"] > 1.0 + 1e-6:
            warnings.append(f"rank {rank}: its MFCs and transfers add up to {100 * entry['total']:.1f}% of the wall "
                            f"time; intervals logged on this rank overlap")
    return shares, warnings


def _group_rows(table: np.ndarray, *keys: str) -> dict[tuple, np.ndarray]:
    """Row indices of ``table`` grouped by the values of ``keys`` (first-seen order)."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(*(table[k].tolist() for k in keys))):
        groups.setdefault(key, []).append(i)
    return {key: np.asarray(rows) for key, rows in groups.items()}


def mfc_order(log: RunLog) -> list[str]:
    """MFC names in the order they run: by median start within their step (ties: first logged first)."""
    step_start = dict(zip(log.steps["step"].tolist(), log.steps["start_seconds"].tolist()))
    offsets = np.array([start - step_start.get(step, start)
                        for step, start in zip(log.mfcs["step"].tolist(), log.mfcs["start_seconds"].tolist())])
    groups = _group_rows(log.mfcs, "name")
    return sorted((name for (name,) in groups), key=lambda n: float(np.median(offsets[groups[(n,)]])))


def representative_step(log: RunLog) -> int:
    """The step ``timeline.png`` draws by default: a step that runs what a typical step runs, of typical length.

    Of the complete steps that run every MFC of the log, those whose MFC rows (how many of each, over all ranks)
    are the most common such pattern (async mode: not the first step, whose warm-up generates several batches;
    never a last step, which generates none), the one of median wall seconds (the lower of the two middle ones, so
    it is a step that ran; ties: the earlier step). Falls back to every complete step when no step runs every MFC.
    """
    steps = log.steps["step"].tolist()
    if not steps:
        raise ValueError(f"{log.path} has no complete step")
    seconds = dict(zip(steps, (log.steps["end_seconds"] - log.steps["start_seconds"]).tolist()))
    every = set(log.mfcs["name"].tolist())
    rows: dict[int, dict[str, int]] = {step: {} for step in steps}
    for step, name in zip(log.mfcs["step"].tolist(), log.mfcs["name"].tolist()):
        if step in rows:
            rows[step][name] = rows[step].get(name, 0) + 1
    full = [step for step in steps if set(rows[step]) == every] or steps
    patterns: dict[tuple, list[int]] = {}
    for step in full:
        patterns.setdefault(tuple(sorted(rows[step].items())), []).append(step)
    typical = max(patterns.values(), key=len)  # the first-seen pattern among equally common ones
    ordered = sorted(typical, key=lambda step: (seconds[step], step))
    return int(ordered[(len(ordered) - 1) // 2])


def mfc_table(log: RunLog, predictions: dict[str, Prediction],
              accuracy: tuple[Band, ProcessBaseline] | None = None) -> list[dict]:
    """One entry per MFC in run order: model, kind, ranks, measured and predicted seconds, errors, peak memory, tokens, FLOPs.

    With ``accuracy`` (``accuracy_for``): each predicted time's band and whether the measured time is inside it, and
    the predicted peak memory as the plan's bytes plus the process baseline, set against the measured peak
    (``memory_compared``) where the plan predicted a non-zero figure; elsewhere memory is measured only.
    """
    entries = []
    by_name = _group_rows(log.mfcs, "name")
    for name in mfc_order(log):
        table = log.mfcs[by_name[(name,)]]
        spans = [float(table["end_seconds"][idx].max() - table["start_seconds"][idx].min())
                 for idx in _group_rows(table, "step").values()]
        measured = float(np.median(spans))
        peak = int(table["peak_memory_bytes"].max())
        predicted = predictions.get(name, Prediction(None, None))
        compared = bool(accuracy and predicted.peak_memory_bytes and peak > 0)
        baseline = accuracy[1].bytes if accuracy else None
        total = predicted.peak_memory_bytes + baseline if compared and predicted.peak_memory_bytes and baseline else None
        band = accuracy[0].seconds(predicted.seconds) if accuracy and predicted.seconds else None
        steps = len(spans)
        entries.append({
            "name": name, "model": str(table["model"][0]), "kind": str(table["kind"][0]),
            "ranks": sorted({int(r) for r in table["rank"]}), "steps": steps,
            "measured_seconds": measured, "measured_seconds_mean": float(np.mean(spans)),
            "predicted_seconds": predicted.seconds,
            "error_percent": _error_percent(predicted.seconds, measured),
            "predicted_band_seconds": band, "inside_band": None if band is None else band[0] <= measured <= band[1],
            "peak_memory_bytes": peak, "predicted_plan_memory_bytes": predicted.peak_memory_bytes,
            "process_baseline_bytes": baseline, "predicted_peak_memory_bytes": total,
            "memory_compared": compared,
            "memory_error_percent": _error_percent(total, peak) if compared else None,
            "tokens_per_step": float(table["tokens"].sum()) / steps, "flops_per_step": float(table["flops"].sum()) / steps,
        })
    return entries


def _error_percent(predicted: float | None, measured: float) -> float | None:
    """Signed error of a prediction: positive when the estimator over-predicts."""
    if predicted is None or measured <= 0:
        return None
    return 100.0 * (predicted - measured) / measured


def movement_totals(log: RunLog, wall_seconds: float) -> dict[str, dict]:
    """Per kind (realloc, transfer): share of wall time some transfer of that kind is in flight, bytes and seconds per step."""
    totals = {}
    steps = max(1, len(log.steps))
    for kind in ("realloc", "transfer"):
        rows = log.transfers[log.transfers["kind"] == kind]
        busy = sum(union_seconds(rows["start_seconds"][idx], rows["end_seconds"][idx])
                   for idx in _group_rows(rows, "step").values())
        totals[kind] = {"count": len(rows), "share": busy / wall_seconds if wall_seconds > 0 else 0.0,
                        "seconds_per_step": busy / steps, "bytes_per_step": float(rows["num_bytes"].sum()) / steps}
    return totals
