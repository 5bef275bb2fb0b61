"""Achieved bf16 GEMM FLOP/s by per-rank shape, beside ``plan/gemm.py``'s predicted efficiency for the same shape.

    python bench/gpu_gemm.py [--json] [--device cuda|cpu] [--cluster NAME] [--shapes models|tiny] [--from FILE]

The shapes are those restage's decoder runs on one tensor-parallel rank (``models/decoder.py``: q, k, v and o,
gate, up and down, and the LM head) and those the estimator costs in their place (``plan/compute.block_gemms``:
q, k and v as one ``qkv`` GEMM, gate and up as one ``gate_up``), for M token rows in ``ROWS`` and the
architectures in ``ARCHS`` (hidden 896 to 8192) at every TP degree of ``TPS`` the runtime accepts (heads and KV
heads divisible). Each shape ``(M x K) @ (K x N)`` runs as the runtime's ``nn.Linear`` does (``F.linear`` with
an ``N x K`` weight). On CUDA, ``inner`` back-to-back calls are captured in one CUDA graph and each of
``--repeats`` replays is timed between CUDA events after ``--warmup`` replays: the GEMM's device time, which
is what ``gemm.py``'s efficiency is of (host launch time is the estimator's separate ``block_overhead_seconds``).
On a CPU the same calls are timed with the wall clock. ``inner`` is sized so that one timed sample lasts about
``TARGET_SAMPLE_SECONDS``, and call ``i`` multiplies the ``i % copies``-th of ``copies`` copies of the
operands, which on CUDA fill ``ROTATE_BYTES`` (``--rotate-bytes``), more than the L2 cache: a small GEMM then reads
its weights from HBM, as each of the runtime's layers does, not from L2. The shapes run in a seeded random order.

Per shape: ``sample_seconds`` (per call, one per repeat), ``seconds`` (their median), ``achieved_tflops``
(2 M N K / ``seconds``), ``measured_efficiency`` (of the cluster's peak for the dtype), ``predicted_efficiency``
(``gemm_efficiency(cluster, M, N, K)``), and the roofline's ``predicted_seconds`` (the larger of the FLOPs at
that efficiency and the bytes moved, A, W and the output once each, at the achievable HBM bandwidth), with
signed errors (positive: the prediction is higher). Per architecture, TP and M, ``blocks`` sets one block's
GEMM seconds as the runtime runs them (7 GEMMs, measured) beside the estimator's
(``RooflineCompute.block_matmuls``). The summary gives median |error|s. ``--max-seconds`` stops measuring
(the result says ``truncated``) so the run fits a device budget. ``--from FILE`` prints a saved JSON as text.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from restage.cluster import ClusterSpec, load_cluster
from restage.demo import LLAMA_300M_SIZES
from restage.device import DTYPES
from restage.models.arch import ModelConfig
from restage.models.flops import BlockShape, block_shape
from restage.models.presets import preset
from restage.plan.compute import DTYPE_BYTES, RooflineCompute, block_gemms
from restage.plan.gemm import gemm_efficiency

ROWS = (1, 8, 64, 512, 4096, 16384)
TPS = (1, 2, 4, 8)
TARGET_SAMPLE_SECONDS = 2e-3
MAX_INNER = 200
# CUDA: the operands of consecutive calls cycle through copies that fill this much memory, more than the L2 cache
# (50 MB on an H100 or H200), so each call reads its weights from HBM as the runtime's successive layers do.
ROTATE_BYTES = 128 * 2**20
MAX_COPIES = 512


def _llama(hidden: int, inter: int, heads: int, kv_heads: int, vocab: int) -> ModelConfig:
    return ModelConfig(family="llama", model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, max_positions=4096)


def model_archs() -> dict[str, ModelConfig]:
    """The architectures whose per-rank GEMMs are measured, hidden 896 to 8192."""
    return {
        # https://huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json: hidden 896, MLP 4864, 14 heads, 2 KV heads
        "qwen2.5-0.5b": _llama(896, 4864, 14, 2, 151936),
        "qwen3-0.6b": preset("qwen3-0.6b"),
        "llama-300m-sort": _llama(LLAMA_300M_SIZES["hidden_size"], LLAMA_300M_SIZES["intermediate_size"],
                                  LLAMA_300M_SIZES["num_heads"], LLAMA_300M_SIZES["num_kv_heads"], 16),
        "llama-1b": preset("llama-1b"),
        "qwen3-4b": preset("qwen3-4b"),
        "llama-7b": preset("llama-7b"),
        "llama-13b": preset("llama-13b"),
        "llama-70b": preset("llama-70b"),
    }


def tiny_archs() -> dict[str, ModelConfig]:
    return {"llama-tiny": preset("llama-tiny")}


def runtime_gemms(s: BlockShape) -> tuple[tuple[str, int, int], ...]:
    """The GEMMs restage's decoder runs per block on one TP rank (models/decoder.py: separate q, k, v, gate, up)."""
    gemms = (("q", s.q_out, s.hidden), ("k", s.kv_out, s.hidden), ("v", s.kv_out, s.hidden), ("o", s.hidden, s.q_out),
             ("gate", s.inter if s.gated else 0, s.hidden), ("up", s.inter, s.hidden), ("down", s.hidden, s.inter))
    return tuple(g for g in gemms if g[1])


def tp_degrees(cfg: ModelConfig) -> list[int]:
    """The TP degrees of ``TPS`` the runtime accepts for ``cfg`` (models/sharding.py: heads and KV heads divide)."""
    return [tp for tp in TPS if cfg.num_heads % tp == 0 and cfg.num_kv_heads % tp == 0]


def shapes_of(archs: dict[str, ModelConfig], rows: tuple[int, ...]) -> dict[tuple[int, int, int], list[str]]:
    """Every distinct (M, N, K), with where it occurs: ``arch/tp<t>/<gemm>`` (runtime and estimator GEMMs, the head)."""
    out: dict[tuple[int, int, int], list[str]] = {}
    for name, cfg in archs.items():
        for tp in tp_degrees(cfg):
            s = block_shape(cfg, tp)
            named = {*runtime_gemms(s), *block_gemms(s), ("head", s.head_out, s.hidden)}
            for gemm, n, k in sorted(named):
                for m in rows:
                    out.setdefault((m, n, k), []).append(f"{name}/tp{tp}/{gemm}")
    return out


def operand_copies(m: int, n: int, k: int, itemsize: int, rotate_bytes: int) -> int:
    """Copies of the operands (A and W) that together fill ``rotate_bytes`` (at most ``MAX_COPIES``; 1 when 0)."""
    if rotate_bytes <= 0:
        return 1
    return max(1, min(MAX_COPIES, math.ceil(rotate_bytes / ((m * k + n * k) * itemsize))))


def _time_samples(run, inner: int, repeats: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds per call of ``run(0) .. run(inner - 1)``, one sample per repeat (CUDA: a graph replay between events)."""
    if device.type == "cuda":  # warm-up on a side stream, then capture (as rollout/decode_graphs.py does)
        current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            run(0)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(inner):
                run(i)
        for _ in range(warmup):
            graph.replay()
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        return samples
    for _ in range(warmup):
        run(0)
    samples = []
    for _ in range(repeats):
        began = time.perf_counter()
        for i in range(inner):
            run(i)
        samples.append((time.perf_counter() - began) / inner)
    return samples


def measure(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, repeats: int, warmup: int,
            rotate_bytes: int) -> dict:
    """Time ``F.linear(a, w)`` with ``a`` M x K and ``w`` N x K (the output preallocated, as a graph needs), call ``i``
    on the ``i % copies``-th copy of the operands (``operand_copies``)."""
    copies = operand_copies(m, n, k, torch.finfo(dtype).bits // 8, rotate_bytes)
    a = torch.randn(copies, m, k, dtype=dtype, device=device)
    w = torch.randn(copies, n, k, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)

    def run(i: int) -> None:
        torch.matmul(a[i % copies], w[i % copies].t(), out=out)  # F.linear(a, w)'s product (the same mm), in place

    if device.type == "cuda":  # one eager call warms cuBLAS (handle, workspace, heuristics) before the graph
        run(0)
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        run(1)
        torch.cuda.synchronize(device)
    else:
        run(0)
        began = time.perf_counter()
        run(1)
    first = max(time.perf_counter() - began, 1e-7)
    calls = max(1, min(MAX_INNER, math.ceil(TARGET_SAMPLE_SECONDS / first)))
    inner = copies * math.ceil(calls / copies)  # every copy used equally often
    samples = _time_samples(run, inner, repeats, warmup, device)
    return {"inner": inner, "copies": copies, "sample_seconds": samples}


def shape_row(cluster: ClusterSpec, dtype: str, m: int, n: int, k: int, where: list[str], timing: dict) -> dict:
    """One shape's measured and predicted figures (see the module docstring)."""
    flops = 2.0 * m * n * k
    seconds = statistics.median(timing["sample_seconds"])
    peak = cluster.peak_flops_per_second(dtype)
    predicted_efficiency = gemm_efficiency(cluster, m, n, k)
    nbytes = (m * k + k * n + m * n) * DTYPE_BYTES[dtype]
    compute_seconds = flops / (peak * predicted_efficiency)
    memory_seconds = nbytes / cluster.achievable_memory_bandwidth()
    predicted_seconds = max(compute_seconds, memory_seconds)
    measured_efficiency = flops / seconds / peak
    return {"rows": m, "cols": n, "depth": k, "where": where, "flops": flops, "bytes": nbytes, **timing,
            "seconds": seconds, "achieved_tflops": flops / seconds / 1e12, "measured_efficiency": measured_efficiency,
            "predicted_efficiency": predicted_efficiency, "predicted_tflops": peak * predicted_efficiency / 1e12,
            "efficiency_error_percent": 100.0 * (predicted_efficiency - measured_efficiency) / measured_efficiency,
            "predicted_seconds": predicted_seconds, "predicted_bound": "compute" if compute_seconds >= memory_seconds
            else "memory", "seconds_error_percent": 100.0 * (predicted_seconds - seconds) / seconds}


def block_rows(cluster: ClusterSpec, dtype: str, archs: dict[str, ModelConfig], shapes: dict) -> list[dict]:
    """Per architecture, TP and M: one block's GEMMs as the runtime runs them (measured) and as the estimator costs them."""
    out = []
    for name, cfg in archs.items():
        roofline = RooflineCompute(cluster, cfg, dtype)
        for tp in tp_degrees(cfg):
            s = block_shape(cfg, tp)
            for m in sorted({m for (m, _, _) in shapes}):
                runtime = [(m, n, k) for _, n, k in runtime_gemms(s)]
                fused = [(m, n, k) for _, n, k in block_gemms(s)]
                if not all(key in shapes for key in runtime + fused):
                    continue  # not measured (truncated)
                measured = sum(shapes[key]["seconds"] for key in runtime)
                predicted = roofline.block_matmuls(m, tp)
                out.append({"arch": name, "tp": tp, "rows": m, "runtime_gemms_seconds": measured,
                            "estimator_gemms_measured_seconds": sum(shapes[key]["seconds"] for key in fused),
                            "predicted_seconds": predicted, "error_percent": 100.0 * (predicted - measured) / measured})
    return out


def _median_abs(values: list[float]) -> float | None:
    return statistics.median(abs(v) for v in values) if values else None


def summarize(rows: list[dict], blocks: list[dict]) -> dict:
    compute = [r for r in rows if r["predicted_bound"] == "compute"]
    by_rows = {str(m): _median_abs([r["efficiency_error_percent"] for r in rows if r["rows"] == m])
               for m in sorted({r["rows"] for r in rows})}
    return {"shapes": len(rows),
            "median_abs_efficiency_error_percent": _median_abs([r["efficiency_error_percent"] for r in rows]),
            "median_abs_efficiency_error_percent_compute_bound": _median_abs([r["efficiency_error_percent"] for r in compute]),
            "median_abs_seconds_error_percent": _median_abs([r["seconds_error_percent"] for r in rows]),
            "within_2x_seconds": sum(1 for r in rows if 0.5 <= r["predicted_seconds"] / r["seconds"] <= 2.0),
            "median_abs_efficiency_error_percent_by_rows": by_rows,
            "median_abs_block_error_percent": _median_abs([b["error_percent"] for b in blocks]),
            "max_measured_efficiency": max((r["measured_efficiency"] for r in rows), default=None)}


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    cluster = load_cluster(args.cluster or ("h200-141gb" if device.type == "cuda" else "local-cpu"))
    archs = model_archs() if args.shapes == "models" else tiny_archs()
    rows_m = ROWS if args.shapes == "models" else (1, 8, 64)
    shapes = shapes_of(archs, rows_m)
    order = list(shapes.items())
    random.Random(0).shuffle(order)  # a run cut short by --max-seconds loses shapes of every size, not the largest
    # torch.cuda.graph collects garbage before each capture: with the imports' objects frozen out of the collector's
    # view that takes microseconds, not tens of milliseconds per shape.
    gc.freeze()
    started, rows, truncated = time.perf_counter(), [], False
    for (m, n, k), where in order:
        if time.perf_counter() - started > args.max_seconds:
            truncated = True
            break
        timing = measure(m, n, k, DTYPES[args.dtype], device, args.repeats, args.warmup, args.rotate_bytes)
        rows.append(shape_row(cluster, args.dtype, m, n, k, where, timing))
    rows.sort(key=lambda r: (r["where"][0].split("/")[0], r["cols"], r["depth"], r["rows"]))
    measured = {(r["rows"], r["cols"], r["depth"]): r for r in rows}
    blocks = block_rows(cluster, args.dtype, archs, measured)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": args.device, "device_name": name, "cluster": cluster.name, "cluster_device": cluster.device,
            "dtype": args.dtype, "torch": torch.__version__, "peak_flops_per_second": cluster.peak_flops_per_second(args.dtype),
            "achievable_memory_bytes_per_second": cluster.achievable_memory_bandwidth(),
            "timing": ("CUDA graph of `inner` calls, each replay timed between CUDA events" if device.type == "cuda"
                       else "wall clock over `inner` calls"),
            "repeats": args.repeats, "warmup": args.warmup, "rotate_bytes": args.rotate_bytes, "shape_set": args.shapes,
            "truncated": truncated,
            "wall_seconds": time.perf_counter() - started, "summary": summarize(rows, blocks), "rows": rows,
            "blocks": blocks}


def format_text(result: dict) -> str:
    s = result["summary"]
    out = [f"{result['dtype']} GEMMs on {result['device_name']} against plan/gemm.py for cluster {result['cluster']} "
           f"({result['dtype']}, peak {result['peak_flops_per_second'] / 1e12:.0f} TFLOP/s; {result['timing']})"
           + (" TRUNCATED" if result["truncated"] else ""),
           f"{'M':>6} {'N':>6} {'K':>6} {'TFLOP/s':>8} {'meas eff':>8} {'pred eff':>8} {'eff err':>8} "
           f"{'meas s':>10} {'pred s':>10} {'s err':>7} bound    where"]
    for r in result["rows"]:
        out.append(f"{r['rows']:>6} {r['cols']:>6} {r['depth']:>6} {r['achieved_tflops']:>8.1f} "
                   f"{r['measured_efficiency']:>8.3f} {r['predicted_efficiency']:>8.3f} {r['efficiency_error_percent']:>+7.0f}% "
                   f"{r['seconds']:>10.3e} {r['predicted_seconds']:>10.3e} {r['seconds_error_percent']:>+6.0f}% "
                   f"{r['predicted_bound']:<8} {r['where'][0]}" + (f" (+{len(r['where']) - 1})" if len(r["where"]) > 1 else ""))
    out += ["", "one block's GEMMs: the runtime's 7 (measured) against the estimator's block_matmuls",
            f"{'arch':<16} {'tp':>2} {'M':>6} {'measured s':>11} {'predicted s':>11} {'error':>7}"]
    for b in result["blocks"]:
        out.append(f"{b['arch']:<16} {b['tp']:>2} {b['rows']:>6} {b['runtime_gemms_seconds']:>11.3e} "
                   f"{b['predicted_seconds']:>11.3e} {b['error_percent']:>+6.0f}%")

    def pct(v) -> str:
        return "-" if v is None else f"{v:.1f}%"
    out += ["", f"{s['shapes']} shapes: median |efficiency error| {pct(s['median_abs_efficiency_error_percent'])} "
            f"(compute-bound by the roofline: {pct(s['median_abs_efficiency_error_percent_compute_bound'])}), median "
            f"|seconds error| {pct(s['median_abs_seconds_error_percent'])}, {s['within_2x_seconds']} within 2x; "
            f"median |block error| {pct(s['median_abs_block_error_percent'])}",
            "median |efficiency error| by M: " + ", ".join(f"{m}: {pct(v)}" for m, v in
                                                          s["median_abs_efficiency_error_percent_by_rows"].items())]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cluster", help="cluster whose prediction is compared (default h200-141gb on cuda, else local-cpu)")
    parser.add_argument("--shapes", choices=["models", "tiny"], help="default: models on cuda, tiny on cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-seconds", type=float, default=180.0, help="stop measuring new shapes after this long")
    parser.add_argument("--rotate-bytes", type=int, help=f"operand copies fill this many bytes (default {ROTATE_BYTES} "
                        "on cuda, 0 on cpu: one copy)")
    parser.add_argument("--from", dest="from_file", metavar="FILE", help="print a saved --json result as text")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.from_file:
        print(format_text(json.loads(Path(args.from_file).read_text())))
        return 0
    args.shapes = args.shapes or ("models" if args.device.startswith("cuda") else "tiny")
    if args.rotate_bytes is None:
        args.rotate_bytes = ROTATE_BYTES if args.device.startswith("cuda") else 0
    with contextlib.redirect_stdout(sys.stderr):  # libraries' notices stay off stdout, which carries the result
        result = run(args)
    print(json.dumps(result, indent=1) if args.json else format_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
