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
  efficiency.

The numbers are only as good as the machine is quiet: run it alone. Progress goes to stderr, one line a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date

import torch

from restage.cluster import load_cluster

GEMM_SIZES = (256, 512, 1024)
STREAM_SIZES = tuple(2 ** k for k in range(14, 29))  # 16 KiB .. 256 MiB per tensor
CACHE_FRACTION = 0.5  # a size streams "from the cache" while it reaches this share of the small sizes' rate


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
        "cluster_values": {
            "cores_per_node": cores,
            "compute_efficiency": round(statistics.median(one.values()) / peak, 3),
            "thread_efficiency": round((speedup - 1) / (cores - 1), 3) if cores > 1 else 1.0,
            "cache_bytes": cache_bytes,
            "cache_bandwidth_bytes_per_second": float(f"{cache_rate:.3g}"),
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
