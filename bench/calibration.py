"""restage's cost model against published measurements of RLHF stages and LLM training (bench/published.py).

    python bench/calibration.py [--json]

For each published point: restage's prediction for the same work under that system's plan, the
measured seconds, the error (predicted / measured - 1), then the median |error| and the largest
ratio either way. Training (DeepSpeed ZeRO-2 / ZeRO-3 with the system's host offload, FSDP; eager) is
predicted with restage's estimator (``plan/estimator.py``) on the system's layout and settings; vLLM
generation with ``plan/generation_cost.py`` (vLLM 0.3.1's per-step Ray cost at TP > 1: ``ray_tp_step_seconds``). One constant is
fitted: the factor by which sustained training GEMMs fall short of the measured burst MAMF
(``compute_efficiency = MAMF x factor``, the same factor for A100 and H100), on every other point
(``FIT``), and scored on the rest as well. ``--fit`` prints the factor that minimises the median
|log(predicted / measured)| over the fit set; the cluster files hold it.

    python bench/calibration.py --fit      # the factor
    python bench/calibration.py [--json]   # published constants only (MAMF) and calibrated (cluster files)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from pathlib import Path

from restage.cluster import ClusterSpec, load_cluster
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.estimator import Estimator
from restage.plan.gemm import mamf_efficiency
from restage.plan.generation_cost import VllmEngine, ray_tp_step_seconds, vllm_generate_seconds
from restage.plan.roles import ModelRole

sys.path.insert(0, str(Path(__file__).resolve().parent))
from published import POINTS, Placed, Published, TrainStage, VllmStage  # noqa: E402  (bench/ is not a package)


def cluster_for(name: str, nodes: int, sustained: float | None = None) -> ClusterSpec:
    """The cluster a point ran on: a cluster file, or a published variant of one; with ``sustained``, its
    ``compute_efficiency`` is the device's MAMF times that factor instead of the file's."""
    cluster = _published_cluster(name, nodes)
    if sustained is None:
        return cluster
    mamf = mamf_efficiency(cluster)
    assert mamf is not None, f"no MAMF figure for {cluster.device}"
    return dataclasses.replace(cluster, compute_efficiency=mamf * sustained)


def _published_cluster(name: str, nodes: int) -> ClusterSpec:
    if name == "a800-80gb":  # A100 silicon, NVLink cut to 400 GB/s in total (200 each way)
        base = load_cluster("a100-80gb", nodes=nodes)
        return dataclasses.replace(base, name=name, device="NVIDIA A800-SXM4-80GB",
                                   intra_node_bandwidth_bytes_per_second=200e9)
    if name == "h100-96gb-500w":  # torchtitan's Grand Teton H100: 96 GiB HBM2e at 2.4 TB/s
        base = load_cluster("h100-80gb", nodes=nodes)
        return dataclasses.replace(base, name=name, memory_bytes=96 * 2**30, memory_bandwidth_bytes_per_second=2.4e12)
    return load_cluster(name, nodes=nodes)


def _role(p: Placed, trainable: bool, checkpointing: bool) -> ModelRole:
    return ModelRole("critic" if p.critic else "actor", preset(p.arch, critic=p.critic), dtype="bf16",
                     trainable=trainable, zero_stage=p.zero_stage, gradient_checkpointing=checkpointing,
                     offload_optimizer=p.offload_optimizer, offload_params=p.offload_params)


def train_seconds(cluster: ClusterSpec, stage: TrainStage) -> float:
    estimator = Estimator(cluster, use_profiles=False)
    times = []
    for p in stage.models:
        minibatches = stage.samples // stage.train_batch
        per_rank = stage.train_batch // p.gpus
        mfc = MFC("train", "train_step", "m", ("seqs",), (), stage.samples, stage.seq_tokens, 0,
                  micro_batches=max(1, per_rank // p.micro_batch), minibatches=minibatches)
        layout = Layout.contiguous(0, Strategy(dp=p.gpus))
        times.append(estimator.estimate(mfc, _role(p, True, stage.gradient_checkpointing), layout).seconds)
    return max(times) if stage.concurrent else sum(times)


def vllm_stage_seconds(cluster: ClusterSpec, stage: VllmStage) -> float:
    """Rounds of (every engine generates its live prompts; the scorers' forward passes over the round), in turn."""
    per_round = stage.engines * stage.live
    rounds = stage.samples / per_round
    engine = VllmEngine(tp=stage.tp, step_overhead_seconds=ray_tp_step_seconds(stage.tp))  # vLLM 0.3.1's Ray TP
    generate = vllm_generate_seconds(cluster, preset(stage.actor), "bf16", engine, stage.live, stage.prompt_tokens,
                                     stage.gen_tokens)
    estimator = Estimator(cluster, use_profiles=False)
    scoring = []
    for p in stage.scorers:
        mfc = MFC("score", "inference", "m", ("seqs",), ("out",), per_round, stage.prompt_tokens, stage.gen_tokens,
                  micro_batches=max(1, per_round // (p.gpus * p.micro_batch)))
        layout = Layout.contiguous(0, Strategy(dp=p.gpus))
        scoring.append(estimator.estimate(mfc, _role(p, False, False), layout).seconds)
    return rounds * (generate + max(scoring))


FIT = frozenset(p.name for p in POINTS[::2])


def predict(point: Published, sustained: float | None = None) -> float:
    cluster = cluster_for(point.cluster, point.nodes, sustained)
    match point.stage:
        case TrainStage() as stage:
            return train_seconds(cluster, stage)
        case VllmStage() as stage:
            return vllm_stage_seconds(cluster, stage)


def _summary(rows: list[dict]) -> dict:
    ratios = [max(r["predicted_seconds"] / r["measured_seconds"], r["measured_seconds"] / r["predicted_seconds"])
              for r in rows]
    return {"points": len(rows), "median_abs_error": statistics.median(abs(r["error"]) for r in rows),
            "max_ratio": max(ratios)}


def evaluate(sustained: float | None = None) -> dict:
    """Every point predicted with the cluster files (``sustained`` None) or with MAMF x ``sustained``."""
    rows = []
    for point in POINTS:
        predicted = predict(point, sustained)
        rows.append({"name": point.name, "set": "fit" if point.name in FIT else "held-out",
                     "measured_seconds": point.measured_seconds, "predicted_seconds": predicted,
                     "error": predicted / point.measured_seconds - 1, "source": point.source, "note": point.note})
    return {"rows": rows, "all": _summary(rows), "fit": _summary([r for r in rows if r["set"] == "fit"]),
            "held_out": _summary([r for r in rows if r["set"] == "held-out"])}


def fit_sustained_factor() -> float:
    """The factor in [0.30, 1.00] (steps of 0.005) minimising the median |log(predicted / measured)| over ``FIT``."""
    fit = [p for p in POINTS if p.name in FIT]

    def loss(factor: float) -> float:
        return statistics.median(abs(math.log(predict(p, factor) / p.measured_seconds)) for p in fit)

    return min((0.30 + 0.005 * i for i in range(141)), key=loss)


def _print(title: str, result: dict) -> None:
    print(title)
    print(f"{'point':40s} {'set':9s} {'measured s':>11s} {'predicted s':>12s} {'error':>7s}")
    for r in result["rows"]:
        print(f"{r['name']:40s} {r['set']:9s} {r['measured_seconds']:11.2f} {r['predicted_seconds']:12.2f} "
              f"{r['error']:+7.0%}")
    for part in ("all", "fit", "held_out"):
        s = result[part]
        print(f"  {part:8s}: median |error| {s['median_abs_error']:.1%}, largest ratio {s['max_ratio']:.2f}x "
              f"({s['points']} points)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--fit", action="store_true", help="print the fitted sustained-GEMM factor")
    args = parser.parse_args()
    if args.fit:
        print(f"sustained factor {fit_sustained_factor():.3f} (compute_efficiency = MAMF x factor)")
        return
    published, calibrated = evaluate(sustained=1.0), evaluate()
    if args.json:
        print(json.dumps({"published_constants": published, "calibrated": calibrated}, indent=1))
        return
    _print("Published constants only (compute_efficiency = MAMF):", published)
    _print("Calibrated (the cluster files):", calibrated)


if __name__ == "__main__":
    main()
