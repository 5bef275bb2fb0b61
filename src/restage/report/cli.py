"""``restage report RUN_DIR [--json] [--png DIR] [--last N] [--step K]`` and ``restage report --sweep SWEEP_DIR``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from restage.errors import LogError
from restage.report.log import read_log
from restage.report.summary import format_text, json_ready, summarize
from restage.report.sweep_report import format_sweep, sweep_rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", help="a run's results directory (holding log.h5), or the log file")
    parser.add_argument("--sweep", metavar="SWEEP_DIR", help="report every trial of a sweep (its index.json) instead")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON instead of a table")
    parser.add_argument("--png", metavar="DIR", help="also write the plots as PNG files into DIR")
    parser.add_argument("--last", type=int, default=20, metavar="N", help="window of the recent-throughput column (20)")
    parser.add_argument("--step", type=int, default=None,
                        help="step of the timeline plot (default: the median-length step of those running every MFC)")


def main(args: argparse.Namespace) -> int:
    if bool(args.run_dir) == bool(args.sweep):
        raise LogError("give either RUN_DIR or --sweep SWEEP_DIR")
    if args.sweep:
        return _sweep_main(args)

    log = read_log(args.run_dir)
    summary = summarize(log, args.last)
    plots = []
    if args.png:
        # lazy: matplotlib, only for --png
        from restage.report.plots import write_plots

        if args.step is not None and args.step not in set(log.steps["step"].tolist()):
            raise LogError(f"--step {args.step} is not a complete step of {log.path} "
                           f"(steps {int(log.steps['step'].min())}..{log.last_complete_step})")
        plots = [str(p) for p in write_plots(log, summary, Path(args.png), args.step)]
    if args.json:
        print(json.dumps(json_ready({**summary, "plots": plots}), indent=2))
    else:
        print(format_text(summary))
        for path in plots:
            print(f"wrote {path}")
    return 0


def _sweep_main(args: argparse.Namespace) -> int:
    rows = sweep_rows(args.sweep, args.last)
    plots = []
    if args.png:
        # lazy: matplotlib, only for --png
        from restage.report.plots import plot_sweep

        plots = [str(plot_sweep(rows, Path(args.png) / "sweep.png"))]
    if args.json:
        print(json.dumps(json_ready({"sweep": str(args.sweep), "trials": rows, "plots": plots}), indent=2))
    else:
        print(format_sweep(rows))
        for path in plots:
            print(f"wrote {path}")
    return 0
