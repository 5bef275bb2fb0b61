"""PNG plots of a run (headless: matplotlib's Agg backend). Pixel sizes are fixed by the data, never by "tight" boxes.

* ``timeline.png``: one iteration (``throughput.representative_step`` unless ``--step``), a row per rank, MFCs
  coloured, reallocations and transfers hatched; 1200 x min(1600, 240 + 40 * ranks) px.
* ``throughput.png``: samples/s and tokens/s per step, then one panel per distinct statistic (up to 6:
  losses first, then reward, KL, the evaluation's curves, the rest); 1200 x 300 * ceil((2 + panels) / 2) px.
* ``predicted.png``: predicted against measured seconds and peak memory per MFC (memory measured only
  where the two are not comparable); 1200 x 500 px.
* ``sweep.png``: throughput of each trial of a sweep; 1000 x 500 px.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from restage.report.log import RunLog  # noqa: E402
from restage.report.throughput import layout_ranks, mfc_order, representative_step  # noqa: E402

DPI = 100
MAX_STAT_PANELS = 6
MOVE_STYLE = {"realloc": ("#555555", "////"), "transfer": ("#c8a060", "xxxx")}


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, pil_kwargs={"compress_level": 1})  # zlib level 1: a third of the encode time
    plt.close(fig)
    return path


def _margins(fig, left: float, right: float, top: float, bottom: float, hspace: float = 0.2, wspace: float = 0.2) -> None:
    """Fixed margins in inches; a layout engine would cost half the plotting time and vary the layout run to run."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height, bottom=bottom / height,
                        hspace=hspace, wspace=wspace)


def _rectangles(ax, starts: np.ndarray, widths: np.ndarray, bottoms: np.ndarray, height: float, **style) -> None:
    """Many rectangles as one collection (one artist per colour instead of one per bar: faster to draw)."""
    verts = [[(x, y), (x + w, y), (x + w, y + height), (x, y + height)] for x, w, y in zip(starts, widths, bottoms)]
    ax.add_collection(PolyCollection(verts, **style))


def mfc_colors(names: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def plot_timeline(log: RunLog, path: Path, step: int | None = None) -> Path:
    """Gantt chart of one iteration (default: ``representative_step``), times from the step's start."""
    chosen = step is None
    step = representative_step(log) if step is None else step
    row = log.steps[log.steps["step"] == step]
    if len(row) == 0:
        raise ValueError(f"step {step} is not a complete step of {log.path}")
    origin, wall = float(row["start_seconds"][0]), float(row["end_seconds"][0] - row["start_seconds"][0])
    ranks = log.world_size
    fig, ax = plt.subplots(figsize=(12, min(16.0, 2.4 + 0.4 * ranks)))
    _margins(fig, left=0.7, right=0.2, top=0.35, bottom=0.95)
    names = mfc_order(log)
    colors = mfc_colors(names)
    mfcs = log.mfcs[log.mfcs["step"] == step]
    for name in names:
        rows = mfcs[mfcs["name"] == name]
        starts, widths = rows["start_seconds"] - origin, rows["end_seconds"] - rows["start_seconds"]
        _rectangles(ax, starts, widths, rows["rank"] - 0.4, 0.8, facecolors=[colors[name]], edgecolors="black",
                    linewidths=0.4)
        if ranks <= 32:
            for start, width, rank in zip(starts, widths, rows["rank"]):
                if width > 0.07 * wall:
                    ax.text(start + width / 2, rank, name, ha="center", va="center", fontsize=7, clip_on=True)
    moves = log.transfers[log.transfers["step"] == step]
    for kind, (color, hatch) in MOVE_STYLE.items():
        boxes = []
        for move in moves[moves["kind"] == kind]:
            occupied = [int(move["rank"])] if move["rank"] >= 0 else sorted(
                set(layout_ranks(move["src"]) or ()) | set(layout_ranks(move["dst"]) or ()))
            boxes += [(move["start_seconds"] - origin, move["end_seconds"] - move["start_seconds"], r) for r in occupied]
        if boxes:
            starts, widths, rows_ = (np.array(column, dtype=float) for column in zip(*boxes))
            # Thin bars along the lower edge of the row, so an overlap with an MFC would stay visible.
            _rectangles(ax, starts, widths, rows_ + 0.05, 0.35, facecolors="white", edgecolors=color, hatch=hatch,
                        linewidths=0.8)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)], fontsize=8 if ranks <= 32 else 5)
    ax.set_xlim(0, wall * 1.01)
    ax.axvline(wall, color="black", linestyle="--", linewidth=0.8)
    ax.set_xlabel("seconds since the start of the step")
    why = ", the median step of those running every MFC" if chosen else ""
    ax.set_title(f"{log.path.parent.name}: iteration timeline of step {step}{why} ({wall:.3f} s wall, dashed line = step end)")
    handles = [Patch(facecolor=colors[n], edgecolor="black", label=n) for n in names]
    handles += [Patch(facecolor="white", edgecolor=c, hatch=h, label=k) for k, (c, h) in MOVE_STYLE.items()]
    fig.legend(handles=handles, loc="lower center", ncol=min(8, len(handles)), fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _stat_rank(name: str) -> int:
    """Panel order: losses, reward, KL, the evaluation's curves (reward, accuracy, length), then the rest."""
    base = name.split("/")[-1].lower()
    if name.startswith("eval/"):
        return 3 + ("reward", "accuracy", "length").index(base) if base in ("reward", "accuracy", "length") else 7
    if base == "loss" or base.endswith("_loss"):
        return 0
    return {"reward": 1, "kl": 2}.get(base, 7)


def stat_panels(series: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[str, list[str]]]:
    """(title, names) of the statistics panels: one per distinct quantity, at most MAX_STAT_PANELS.

    Series with the same steps and values are one quantity (``prepare_train``'s reward and KL are
    logged under every train MFC; a loss equal to its policy loss): one panel, titled by their common
    last name parts and the MFCs they were logged under. Losses come first, then reward, KL and the
    evaluation's curves, then the rest.
    """
    groups: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
    for name, (steps, values) in series.items():
        for group_steps, group_values, names in groups:
            # Equal up to float32 rounding: each train MFC reduces the same reward over its own DP layout.
            if np.array_equal(steps, group_steps) and np.allclose(values, group_values, rtol=1e-5, atol=1e-6,
                                                                   equal_nan=True):
                names.append(name)
                break
        else:
            groups.append((steps, values, [name]))
    panels = []
    for _, _, names in groups:
        panels.append((min(_stat_rank(n) for n in names), _panel_title(names), names))
    panels.sort(key=lambda panel: panel[0])  # stable: first-logged first within a rank
    return [(title, names) for _, title, names in panels[:MAX_STAT_PANELS]]


def _panel_title(names: list[str]) -> str:
    """``actor_train/loss``; ``actor_train/loss = policy_loss``; ``reward = shaped_reward (actor_train, critic_train)``."""
    if len(names) == 1:
        return names[0]
    prefixes = list(dict.fromkeys(n.rpartition("/")[0] for n in names))
    bases = " = ".join(dict.fromkeys(n.rpartition("/")[2] for n in names))
    if len(prefixes) == 1:
        return f"{prefixes[0]}/{bases}" if prefixes[0] else bases
    return f"{bases} ({', '.join(p for p in prefixes if p)})"


def _rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    window = max(1, min(window, len(values)))
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.maximum(0, np.arange(1, len(values) + 1) - window)]) / counts


def plot_throughput(log: RunLog, path: Path, window: int = 10) -> Path:
    """Samples/s and tokens/s per step (thin) with a ``window``-step trailing mean (thick), then key statistics."""
    series = log.stat_series()
    chosen = stat_panels(series)
    panels = 2 + len(chosen)
    nrows = math.ceil(panels / 2)
    fig, axes = plt.subplots(nrows, 2, figsize=(12, 3 * nrows), squeeze=False)
    _margins(fig, left=0.8, right=0.3, top=0.6, bottom=0.5, hspace=0.45 * 3 / 3, wspace=0.18)
    order = np.argsort(log.steps["step"])
    steps = log.steps[order]
    wall = steps["end_seconds"] - steps["start_seconds"]
    with np.errstate(divide="ignore", invalid="ignore"):
        rates = {"samples/s": steps["samples"] / wall, "tokens/s": steps["tokens"] / wall}
    for ax, (label, values), color in zip(axes.flat, rates.items(), ("tab:blue", "tab:orange")):
        ax.plot(steps["step"], values, color=color, linewidth=0.8, alpha=0.5, label="per step")
        ax.plot(steps["step"], _rolling_mean(values, window), color=color, linewidth=2, label=f"mean of last {window}")
        ax.set_title(f"{label} per step")
        ax.legend(fontsize=7, loc="lower right")
    for ax, (title, names) in zip(axes.flat[2:], chosen):
        xs, ys = series[names[0]]
        evaluated = names[0].startswith("eval/")  # only at the evaluation cadence: mark each point
        ax.plot(xs, ys, linewidth=1, color="tab:purple" if evaluated else "tab:green", marker="o" if evaluated else None,
                markersize=3)
        ax.set_title(title)
    for ax in axes.flat[:panels]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, counted from 1
        ax.set_xlabel("step", labelpad=1)
        ax.grid(alpha=0.3)
    for ax in axes.flat[panels:]:
        ax.set_visible(False)
    fig.suptitle(f"{log.path.parent.name}: steps {int(steps['step'][0])}..{int(steps['step'][-1])}"
                 + ("" if log.closed else f" (log not closed: up to step {log.last_complete_step})"))
    return _save(fig, path)


def _bars_with_error(ax, labels: list[str], predicted: list[float], measured: list[float], scale: float, unit: str) -> None:
    x = np.arange(len(labels))
    ax.bar(x - 0.2, [p / scale for p in predicted], 0.4, label="predicted", color="tab:gray")
    ax.bar(x + 0.2, [m / scale for m in measured], 0.4, label="measured", color="tab:blue")
    for i, (p, m) in enumerate(zip(predicted, measured)):
        ax.annotate(f"{100 * (p - m) / m:+.0f}%", (i, max(p, m) / scale), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(x, labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    ax.margins(y=0.15)


def plot_predicted(summary: dict, path: Path, title: str = "") -> Path | None:
    """Predicted against measured seconds (left) and peak memory (right) per MFC; None if the schedule predicts nothing."""
    timed = [m for m in summary["mfcs"] if m["predicted_seconds"] and m["measured_seconds"] > 0]
    sized = [m for m in summary["mfcs"] if m["memory_compared"]]
    if not timed and not sized:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    _margins(fig, left=0.7, right=0.2, top=0.6, bottom=1.0, wspace=0.2)
    _bars_with_error(left, [m["name"] for m in timed], [m["predicted_seconds"] for m in timed],
                     [m["measured_seconds"] for m in timed], 1.0, "seconds per step (measured: median span)")
    left.set_title("time per MFC (label: prediction error)")
    if sized:
        _bars_with_error(right, [m["name"] for m in sized], [m["predicted_peak_memory_bytes"] for m in sized],
                         [m["peak_memory_bytes"] for m in sized], 2**30, "peak memory per rank, GiB")
        right.set_title("peak memory per MFC (label: prediction error)")
    else:  # nothing to compare (summary["memory_note"] says why): what was measured, without a prediction
        measured = [m for m in summary["mfcs"] if m["peak_memory_bytes"] > 0]
        x = np.arange(len(measured))
        right.bar(x, [m["peak_memory_bytes"] / 2**30 for m in measured], 0.5, color="tab:blue")
        right.set_xticks(x, [m["name"] for m in measured], rotation=30, ha="right", fontsize=8)
        right.set_ylabel("peak memory per rank, GiB")
        right.set_title("peak memory per MFC, measured only (not comparable to the estimate)", fontsize=10)
        right.text(0.5, 0.97, "\n".join(textwrap.wrap(summary.get("memory_note") or "", 70)), transform=right.transAxes,
                   ha="center", va="top", fontsize=7)
        right.margins(y=0.3)
    handles = [Patch(facecolor="tab:gray", label="predicted"), Patch(facecolor="tab:blue", label="measured")]
    fig.legend(handles=handles, loc="upper right", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(title or "estimator: predicted against measured")
    return _save(fig, path)


def plot_sweep(rows: list[dict], path: Path, metric: str = "samples_per_second") -> Path:
    """One bar per trial (trials without a log get no bar), labelled with the trial name."""
    fig, ax = plt.subplots(figsize=(10, 5))
    _margins(fig, left=0.8, right=0.2, top=0.4, bottom=1.3)
    names = [r["name"] for r in rows]
    values = [r.get(metric) or 0.0 for r in rows]
    bars = ax.bar(np.arange(len(rows)), values, color=["tab:blue" if r.get(metric) else "tab:red" for r in rows])
    for bar, row in zip(bars, rows):
        done = bool(row.get(metric))  # the table says why a trial has no result; the chart only marks it
        ax.annotate(f"{row[metric]:.3g}" if done else "no result", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8, color="black" if done else "tab:red", xytext=(0, 2),
                    textcoords="offset points")
    ax.set_xticks(np.arange(len(rows)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(metric.replace("_per_second", "/s").replace("_", " "))
    ax.set_title("sweep: throughput per trial")
    ax.margins(y=0.12)
    return _save(fig, path)


def write_plots(log: RunLog, summary: dict, out_dir: Path, step: int | None = None) -> list[Path]:
    """Every plot of one run into ``out_dir``; return the files written."""
    out_dir = Path(out_dir)
    written = [plot_timeline(log, out_dir / "timeline.png", step), plot_throughput(log, out_dir / "throughput.png")]
    predicted = plot_predicted(summary, out_dir / "predicted.png", f"{log.path.parent.name}: estimator against the run")
    return written + ([predicted] if predicted else [])
