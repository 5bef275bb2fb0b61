"""The CPU rates the roofline needs for ranks without a measured profile: one thread's GEMM rate, what more threads add,
and how fast an op streams while its tensors stay in the cache.

    python bench/cpu_rates.py [--cluster local-cpu] [--repeats 5] [--json] [--out FILE]

Measured, never fitted to a job:

* ``compute_efficiency``: the median fp32 GEMM rate of one thread over ``GEMM_SIZES`` square products, over the
  cluster file's ``peak_fp32_flops_per_second`` (one core's);
* ``thread_efficiency``: the same GEMMs on every core of the machine (``torch.set_num_threads``), the median speedup
  over one thread, less 1, over the extra threads;
* ``cache_bytes`` and ``cache_bandwidth_bytes_per_second``: ``c = a + b`` on one thread over three tensors of
  ``STREAM_SIZES`` bytes each, bytes moved = 3 x size. ``cache_bytes`` is the largest size that still streams at
  ``CACHE_FRACTION`` of the fastest size's rate (every size between them too): the largest tensor an op may hold
  and stay in the cache with its two companions; the cache rate is the median over the sizes at that share or more.
  The largest size gives memory's rate, printed beside the cluster file's ``memory_bandwidth_bytes_per_second`` x
  efficiency;
* ``gemm_half_rows``: one thread's ``F.linear`` of ``ROWS`` rows through a warm ``ROWS_WEIGHT`` weight; the ``h`` of
  ``rows / (rows + h)``, normalised to 1 at ``CPU_REFERENCE_ROWS``, that fits the rates over the largest (least
  squares of the logs, rows >= 4: fewer rows are bound by the weight's bytes, which the roofline counts apart);
* ``weight_read_bytes_per_second``: the same product with a cold weight (each call a different one of a pool of
  ``COLD_POOL_BYTES``, more than the last-level cache) takes longer than with a warm one by a time that hardly
  depends on the rows: the BLAS reading and packing the weight. Its rate is the pooled bytes over the pooled extra
  seconds of ``WEIGHT_SHAPES`` at ``COLD_ROWS`` rows.

The numbers are only as good as the machine is quiet: run it alone. Progress goes to stderr, one line a measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import date

import torch
import torch.nn.functional as F

from restage.cluster import load_cluster
from restage.plan.gemm import CPU_REFERENCE_ROWS

GEMM_SIZES = (256, 512, 1024)
STREAM_SIZES = tuple(2 ** k for k in range(14, 29))  # 16 KiB .. 256 MiB per tensor
CACHE_FRACTION = 0.5  # a size streams "from the cache" while it reaches this share of the small sizes' rate
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, CPU_REFERENCE_ROWS)
ROWS_WEIGHT = (1376, 512)  # (out, in): a 512-wide LLaMA's gate projection
WEIGHT_SHAPES = ((704, 256), (1376, 512), (1728, 640), (2048, 1024))  # MLP weights of 256-1024-wide models
COLD_POOL_BYTES = 256 << 20
COLD_ROWS = (1, 16)  # rows of the cold-weight products


def _best_seconds(fn, repeats: int, min_seconds: float = 0.05) -> float:
    """The fastest of ``repeats`` timings, each of enough calls to take ``min_seconds``: seconds per call."""
    fn()
    calls, start = 1, time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-7)
    calls = max(1, int(min_seconds / one))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def gemm_rate(n: int, threads: int, repeats: int) -> float:
    """FLOP/s of an fp32 (n x n) @ (n x n) product on ``threads`` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n ** 3 / _best_seconds(lambda: torch.mm(a, b, out=out), repeats)


def stream_rate(nbytes: int, repeats: int) -> float:
    """Bytes per second of ``c = a + b`` over three fp32 tensors of ``nbytes`` each, on one thread."""
    torch.set_num_threads(1)
    n = nbytes // 4
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    return 3 * nbytes / _best_seconds(lambda: torch.add(a, b, out=c), repeats)


def linear_rate(rows: int, repeats: int) -> float:
    """FLOP/s of one thread's ``F.linear`` of ``rows`` rows through a warm ``ROWS_WEIGHT`` weight."""
    torch.set_num_threads(1)
    out_features, in_features = ROWS_WEIGHT
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    return 2 * rows * out_features * in_features / _best_seconds(lambda: F.linear(x, w), repeats)


def half_rows(rates: dict[int, float]) -> float:
    """The ``h`` (0.25 steps up to 64) whose ``rows / (rows + h)``, over its value at the largest rows, best fits
    ``rates`` over the largest's rate (least squares of the logs over rows >= 4)."""
    top = max(rates)
    used = [r for r in rates if r >= 4]

    def misfit(h: float) -> float:
        return sum((math.log((r / (r + h)) / (top / (top + h))) - math.log(rates[r] / rates[top])) ** 2 for r in used)

    return min((k / 4 for k in range(1, 257)), key=misfit)


def cold_extra_seconds(out_features: int, in_features: int, rows: int, repeats: int) -> float:
    """Seconds a cold weight adds to one thread's ``F.linear`` of ``rows`` rows: a pass over a pool of distinct
    weights (``COLD_POOL_BYTES``) per call, the fastest of ``repeats`` passes, less the warm call's best."""
    torch.set_num_threads(1)
    pool = [torch.randn(out_features, in_features)
            for _ in range(max(8, COLD_POOL_BYTES // (4 * out_features * in_features)))]
    x = torch.randn(rows, in_features)
    for w in pool:
        F.linear(x, w)
    cold = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in pool:
            F.linear(x, w)
        cold = min(cold, (time.perf_counter() - start) / len(pool))
    return max(cold - _best_seconds(lambda: F.linear(x, pool[0]), repeats), 0.0)


def cache_edge(rates: dict[int, float]) -> tuple[int, float]:
    """(cache_bytes, cache rate). The sizes "in the cache" run from the fastest size up to the last size before the
    rate first falls below ``CACHE_FRACTION`` of the fastest; ``cache_bytes`` is the largest of them and the rate
    their median. The smallest sizes are left out: they are slower per byte only because one call's overhead
    weighs on few bytes, which the roofline counts apart (``block_overhead_seconds``)."""
    sizes = sorted(rates)
    fastest = max(sizes, key=lambda s: rates[s])
    inside = [fastest]
    for size in sizes[sizes.index(fastest) + 1:]:
        if rates[size] < CACHE_FRACTION * rates[fastest]:
            break
        inside.append(size)
    below = [s for s in sizes[:sizes.index(fastest)] if rates[s] >= CACHE_FRACTION * rates[fastest]]
    return inside[-1], statistics.median(rates[s] for s in below + inside)


def measure(cluster_name: str, repeats: int) -> dict:
    cluster = load_cluster(cluster_name)
    cores = len(os.sched_getaffinity(0))
    peak = cluster.peak_fp32_flops_per_second
    one, many = {}, {}
    for n in GEMM_SIZES:
        one[n] = gemm_rate(n, 1, repeats)
        many[n] = gemm_rate(n, cores, repeats)
        print(f"cpu_rates: gemm {n}: {one[n] / 1e9:.1f} GFLOP/s on 1 thread, {many[n] / 1e9:.1f} on {cores}",
              file=sys.stderr)
    streams = {}
    for size in STREAM_SIZES:
        streams[size] = stream_rate(size, repeats)
        print(f"cpu_rates: stream 3 x {size} B: {streams[size] / 1e9:.2f} GB/s", file=sys.stderr)
    by_rows = {rows: linear_rate(rows, repeats) for rows in ROWS}
    print("cpu_rates: F.linear by rows: " + ", ".join(f"{r} {v / 1e9:.0f}" for r, v in by_rows.items()) + " GFLOP/s",
          file=sys.stderr)
    extra = {f"{o}x{i}x{rows}": cold_extra_seconds(o, i, rows, repeats) for o, i in WEIGHT_SHAPES for rows in COLD_ROWS}
    print("cpu_rates: a cold weight adds " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in extra.items()),
          file=sys.stderr)
    read_bytes = len(COLD_ROWS) * sum(4 * o * i for o, i in WEIGHT_SHAPES)
    speedup = statistics.median(many[n] / one[n] for n in GEMM_SIZES)
    cache_bytes, cache_rate = cache_edge(streams)
    memory_rate = streams[max(STREAM_SIZES)]
    return {
        "cluster": cluster.name, "date": date.today().isoformat(), "cores": cores, "torch": torch.__version__,
        "gemm_flops_per_second_1_thread": {str(n): one[n] for n in GEMM_SIZES},
        "gemm_flops_per_second_all_threads": {str(n): many[n] for n in GEMM_SIZES},
        "stream_bytes_per_second": {str(s): streams[s] for s in STREAM_SIZES},
        "memory_bytes_per_second_measured": memory_rate,
        "memory_bytes_per_second_cluster_file": cluster.achievable_memory_bandwidth(),
        "linear_flops_per_second_by_rows": {str(r): v for r, v in by_rows.items()},
        "cold_weight_extra_seconds": extra,
        "cluster_values": {
            "cores_per_node": cores,
            "compute_efficiency": round(statistics.median(one.values()) / peak, 3),
            "thread_efficiency": round((speedup - 1) / (cores - 1), 3) if cores > 1 else 1.0,
            "cache_bytes": cache_bytes,
            "cache_bandwidth_bytes_per_second": float(f"{cache_rate:.3g}"),
            "gemm_half_rows": half_rows(by_rows),
            "weight_read_bytes_per_second": float(f"{read_bytes / sum(extra.values()):.3g}"),
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="local-cpu", help="cluster file whose peak the GEMM rate is set against")
    parser.add_argument("--repeats", type=int, default=5, help="timings per measurement; the fastest is kept")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", default="", help="also write the JSON to this file")
    args = parser.parse_args(argv)
    result = measure(args.cluster, args.repeats)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result["cluster_values"].items():
            print(f"{key}: {value}")
        print(f"memory, measured: {result['memory_bytes_per_second_measured'] / 1e9:.2f} GB/s "
              f"(cluster file x efficiency: {result['memory_bytes_per_second_cluster_file'] / 1e9:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
