"""Time ``restage report`` on a 200-step, 8-rank synthetic PPO log (target: under 2 s).

Prints, for the report without and with plots: the in-process time (read log, compute, format;
plus the three PNGs) and the wall time of the whole command in a fresh interpreter (imports included).
``--json`` prints the same figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def best_of(repeats: int, fn) -> tuple[float, float]:
    """Best wall seconds and best CPU seconds of ``repeats`` calls (CPU time is what an idle core would take)."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def command_seconds(argv: list[str], repeats: int) -> tuple[float, float]:
    """Median wall and CPU (user + system) seconds of ``restage ARGV`` in a fresh interpreter."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    walls, cpus = [], []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "restage.cli", *argv], check=True, stdout=subprocess.DEVNULL, env=env)
        walls.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def writer_seconds_per_step(folder: Path, steps: int, ranks: int) -> tuple[float, float]:
    """Seconds the master spends in LogWriter per step: recording 6 MFC rows per rank, then end_step (one journal line)."""
    from restage.report.log_writer import LogWriter

    writer = LogWriter(folder / "writer.h5", world_size=ranks)
    record = close = 0.0
    for step in range(1, steps + 1):  # steps count from 1
        start = time.perf_counter()
        for mfc in range(6):
            for rank in range(ranks):
                writer.mfc(step, f"mfc{mfc}", "actor", "inference", rank, 1.0, 2.0, 100, 1e12, 2**30)
        writer.realloc(step, "actor", "[0-7]dp8tp1pp1", "[0-3]dp1tp4pp1", 2**30, 0.0, 1.0)
        writer.stats(step, {"loss": 1.0, "reward": 0.5, "kl": 0.1})
        middle = time.perf_counter()
        writer.end_step(step, 0.0, 2.0, 64, 16384, 1e15)
        record, close = record + middle - start, close + time.perf_counter() - middle
    writer.close()
    return record / steps, close / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from restage.report.log import read_log
    from restage.report.summary import format_text, summarize
    from restage.report.synthetic import write_synthetic_log

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = write_synthetic_log(Path(tmp) / "run" / "log.h5", steps=args.steps, world_size=args.ranks)
        write_seconds = time.perf_counter() - start
        log = read_log(path)
        record_seconds, end_step_seconds = writer_seconds_per_step(Path(tmp), args.steps, args.ranks)
        figures = {
            "steps": args.steps, "ranks": args.ranks, "mfc_rows": int(len(log.mfcs)), "log_bytes": path.stat().st_size,
            "write_log_seconds": write_seconds,
            "writer_record_seconds_per_step": record_seconds, "writer_end_step_seconds": end_step_seconds,
        }
        timed = {"report_in_process": lambda: best_of(args.repeats, lambda: format_text(summarize(read_log(path))))}
        from restage.report.plots import write_plots

        timed["plots_in_process"] = lambda: best_of(args.repeats, lambda: write_plots(log, summarize(log), Path(tmp) / "png"))
        timed["command_text"] = lambda: command_seconds(["report", str(path.parent)], args.repeats)
        timed["command_json"] = lambda: command_seconds(["report", str(path.parent), "--json"], args.repeats)
        timed["command_with_png"] = lambda: command_seconds(
            ["report", str(path.parent), "--png", str(Path(tmp) / "cli_png")], args.repeats)
        for key, measure in timed.items():
            figures[f"{key}_seconds"], figures[f"{key}_cpu_seconds"] = measure()
        figures["load_average"] = os.getloadavg()[0]
    figures["target_seconds"] = 2.0
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"synthetic log: {args.steps} steps, {args.ranks} ranks, {figures['mfc_rows']} MFC rows, "
          f"{figures['log_bytes'] / 1e6:.2f} MB, generated and written in {write_seconds:.2f} s")
    print(f"LogWriter per step ({args.ranks} ranks x 6 MFCs): recording rows {1e3 * record_seconds:.3f} ms, "
          f"end_step (one journal line) {1e3 * end_step_seconds:.3f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; seconds as wall / CPU")
    rows = (("report in process (read, numbers, text)", "report_in_process"), ("plots in process (3 PNGs)", "plots_in_process"),
            ("restage report RUN (fresh interpreter)", "command_text"), ("restage report RUN --json", "command_json"),
            ("restage report RUN --png DIR", "command_with_png"))
    for label, key in rows:
        print(f"{label:<42} {figures[key + '_seconds']:.3f} / {figures[key + '_cpu_seconds']:.3f} s")
    print("target: under 2 s")


if __name__ == "__main__":
    main()
