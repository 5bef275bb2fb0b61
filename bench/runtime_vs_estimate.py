"""restage's measured seconds and memory per MFC beside what its estimator predicted for the same plan, from one run.

    python bench/runtime_vs_estimate.py RUN_DIR [--json]

``RUN_DIR`` is a finished ``restage run``'s trial directory (its ``log.h5`` carries the schedule the planner
wrote, with each MFC's predicted seconds, their breakdown and the predicted peak memory). The figures are
``restage report``'s (``report.summary.summarize``: measured = the median over steps of an MFC's span over its
ranks; predicted peak memory = the plan's bytes plus the process baseline of ``restage/accuracy.py``); added
here: each MFC's measured seconds per step (the first step includes warm-up: CUDA-graph captures, cuBLAS
heuristics), measured / predicted, the estimator's breakdown of its prediction, the FLOP/s the MFC achieved
(the runtime's own FLOP count per step over the median seconds), and the median |error| over the MFCs.
``scripts/gpu_check.sh OUT costs`` runs it on a GPU (docs/plan.md, "restage's runtime on a GPU against its
estimator").

    python bench/runtime_vs_estimate.py --sizes OUT --device cuda|cpu --cluster NAME

gathers ``scripts/gpu_check.sh OUT sizes``' three runs (issue 30 item 3: ``OUT/sizes_status.txt``, one line per size
``size job rc seconds budget``, and each size's ``sizes_<size>_model.txt`` and ``sizes_<size>_runtime.json``) into
``OUT/sizes.json``: the date, device, torch; per size its parameters and, per MFC, measured and predicted seconds,
their error (predicted / measured - 1) and memory; a size that failed is kept with its log's tail (and the figures
of the steps it logged, if any).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from restage.report.log import RunLog, read_log
from restage.report.summary import json_ready, summarize

GIB = 2**30


def step_seconds(log: RunLog, name: str) -> list[float]:
    """The MFC's span over its ranks in each step, in step order."""
    table = log.mfcs[log.mfcs["name"] == name]
    steps = sorted({int(s) for s in table["step"]})
    spans = []
    for step in steps:
        rows = table[table["step"] == step]
        spans.append(float(np.max(rows["end_seconds"]) - np.min(rows["start_seconds"])))
    return spans


def breakdowns(schedule: dict | None) -> dict[str, dict]:
    """Each MFC's predicted breakdown (compute, decode, communication, ...) from the schedule."""
    out = {}
    for entry in (schedule or {}).get("mfcs", []) or []:
        predicted = entry.get("predicted") or {}
        out[str(entry["name"])] = {"breakdown": predicted.get("breakdown") or {}, "source": predicted.get("source"),
                                   "layout": entry.get("layout"), "micro_batches": entry.get("micro_batches"),
                                   "n_seqs": entry.get("n_seqs"), "prompt_tokens": entry.get("prompt_tokens"),
                                   "gen_tokens": entry.get("gen_tokens")}
    return out


def compare(run_dir: str | Path) -> dict:
    """The run's predicted against measured seconds and memory, per MFC and for the iteration."""
    log = read_log(run_dir)
    summary = summarize(log, last_n=len(log.steps))
    extra = breakdowns(log.schedule)
    mfcs = []
    for m in summary["mfcs"]:
        predicted, measured = m["predicted_seconds"], m["measured_seconds"]
        mfcs.append({
            "name": m["name"], "model": m["model"], "kind": m["kind"], "ranks": m["ranks"], "steps": m["steps"],
            "measured_seconds": measured, "step_seconds": step_seconds(log, m["name"]),
            "predicted_seconds": predicted, "error_percent": m["error_percent"],
            "measured_over_predicted": measured / predicted if predicted else None,
            "predicted_source": extra.get(m["name"], {}).get("source"),
            "predicted_breakdown": extra.get(m["name"], {}).get("breakdown", {}),
            "work": {k: v for k, v in extra.get(m["name"], {}).items() if k not in ("breakdown", "source")},
            "achieved_tflops": m["flops_per_step"] / measured / 1e12 if measured > 0 else None,
            "peak_memory_bytes": m["peak_memory_bytes"], "predicted_plan_memory_bytes": m["predicted_plan_memory_bytes"],
            "process_baseline_bytes": m["process_baseline_bytes"],
            "predicted_peak_memory_bytes": m["predicted_peak_memory_bytes"],
            "memory_error_percent": m["memory_error_percent"]})
    errors = [abs(m["error_percent"]) for m in mfcs if m["error_percent"] is not None]
    cluster = log.cluster or (log.schedule or {}).get("cluster") or {}
    return {"run": str(run_dir), "experiment": (log.schedule or {}).get("experiment"), "cluster": cluster.get("name"),
            "cluster_device": cluster.get("device"), "world_size": log.world_size, "status": summary["status"],
            "steps": summary["throughput"]["all"]["steps"], "iteration": summary["iteration"],
            "median_abs_mfc_error_percent": statistics.median(errors) if errors else None,
            "mfcs": mfcs, "warnings": summary["warnings"]}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_text(result: dict) -> str:
    it = result["iteration"]
    out = [f"{result['experiment']} on {result['world_size']} rank(s), costed as {result['cluster']} "
           f"({result['cluster_device']}); {result['steps']} steps; {result['status']}",
           f"iteration: measured {it['measured_seconds']:.3f} s (median step), predicted "
           f"{_fmt(it['predicted_seconds'], '.3f')} s ({_fmt(it['error_percent'], '+.1f')}%)",
           f"{'mfc':<14} {'measured s':>10} {'predicted s':>11} {'error':>7} {'meas/pred':>9} {'TFLOP/s':>8} "
           f"{'peak GiB':>8} {'pred GiB':>8} {'mem err':>7}  per step s"]
    for m in result["mfcs"]:
        pred_gib = None if m["predicted_peak_memory_bytes"] is None else m["predicted_peak_memory_bytes"] / GIB
        out.append(f"{m['name']:<14} {m['measured_seconds']:>10.4f} {_fmt(m['predicted_seconds'], '>11.4f')} "
                   f"{_fmt(m['error_percent'], '>+6.1f')}% {_fmt(m['measured_over_predicted'], '>9.2f')} "
                   f"{_fmt(m['achieved_tflops'], '>8.1f')} {m['peak_memory_bytes'] / GIB:>8.2f} {_fmt(pred_gib, '>8.2f')} "
                   f"{_fmt(m['memory_error_percent'], '>+6.1f')}%  "
                   + " ".join(f"{s:.3f}" for s in m["step_seconds"]))
    out.append(f"median |error| over the MFCs: {_fmt(result['median_abs_mfc_error_percent'], '.1f')}%")
    out.append("predicted breakdown (s):")
    for m in result["mfcs"]:
        parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.4f}" for k, v in m["predicted_breakdown"].items() if v)
        out.append(f"  {m['name']:<14} {parts}")
    out += [f"warning: {w}" for w in result["warnings"]]
    return "\n".join(out)


def model_params(path: Path) -> int:
    """The number of parameters in a model directory's safetensors files (read from their headers)."""
    from safetensors import safe_open  # only the sizes' gathering reads weight files

    params = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as weights:
            for name in weights.keys():
                params += int(np.prod(weights.get_slice(name).get_shape(), dtype=np.int64))
    return params


SIZE_CONFIG_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "torch_dtype", "dtype")


def size_entry(out: Path, size: str, job: str, rc: int, wall_seconds: int, budget_seconds: int) -> dict:
    """One size of ``scripts/gpu_check.sh OUT sizes``: its model, and its run's figures or its failure."""
    entry: dict = {"size": size, "job": job, "status": "ok" if rc == 0 else "failed", "rc": rc,
                   "wall_seconds": wall_seconds, "budget_seconds": budget_seconds, "params": None}
    model = out / f"sizes_{size}_model.txt"
    lines = model.read_text().split() if model.is_file() else []
    if lines and (Path(lines[-1]) / "config.json").is_file():
        path = Path(lines[-1])
        config = json.loads((path / "config.json").read_text())
        entry |= {"model": str(path), "params": model_params(path),
                  "model_config": {k: config[k] for k in SIZE_CONFIG_KEYS if k in config}}
    runtime = out / f"sizes_{size}_runtime.json"
    if runtime.is_file():  # a failed run's figures are kept too (the steps it logged), its status says failed
        run = json.loads(runtime.read_text())
        entry |= {"run": run["run"], "experiment": run["experiment"], "steps": run["steps"],
                  "world_size": run["world_size"], "iteration": run["iteration"],
                  "median_abs_mfc_error_percent": run["median_abs_mfc_error_percent"], "warnings": run["warnings"]}
        entry["mfcs"] = [{
            "name": m["name"], "model": m["model"], "kind": m["kind"], "measured_seconds": m["measured_seconds"],
            "step_seconds": m["step_seconds"], "predicted_seconds": m["predicted_seconds"],
            "error": (m["predicted_seconds"] / m["measured_seconds"] - 1
                      if m["predicted_seconds"] is not None and m["measured_seconds"] > 0 else None),
            "error_percent": m["error_percent"], "predicted_breakdown": m["predicted_breakdown"],
            "achieved_tflops": m["achieved_tflops"], "peak_memory_bytes": m["peak_memory_bytes"],
            "predicted_peak_memory_bytes": m["predicted_peak_memory_bytes"],
            "memory_error_percent": m["memory_error_percent"]} for m in run["mfcs"]]
    else:
        entry["status"] = "failed"
    if entry["status"] == "failed":
        log = out / f"sizes_{size}_run.log"
        entry["log_tail"] = log.read_text(errors="replace").splitlines()[-20:] if log.is_file() else []
    return entry


def gather_sizes(out: str | Path, device: str, cluster: str) -> dict:
    """``scripts/gpu_check.sh OUT sizes``' runs as one record (written to ``OUT/sizes.json`` by ``--sizes``)."""
    import torch  # the record names the torch and device the runs used

    out = Path(out)
    result: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "device": device,
                    "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                    "cluster": cluster, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device == "cuda":
        result["total_memory_bytes"] = torch.cuda.mem_get_info(0)[1]
    result["sizes"] = []
    for line in (out / "sizes_status.txt").read_text().splitlines():
        size, job, rc, wall_seconds, budget_seconds = line.split()
        result["sizes"].append(size_entry(out, size, job, int(rc), int(wall_seconds), int(budget_seconds)))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", nargs="?", help="a finished run's trial directory (or its log.h5)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--sizes", metavar="OUT", help="gather scripts/gpu_check.sh OUT sizes' runs into OUT/sizes.json")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="with --sizes: where they ran")
    parser.add_argument("--cluster", default="", help="with --sizes: the cluster file they were costed as")
    args = parser.parse_args(argv)
    if args.sizes:
        sizes = gather_sizes(args.sizes, args.device, args.cluster)
        (Path(args.sizes) / "sizes.json").write_text(json.dumps(json_ready(sizes), indent=1) + "\n")
        print(f"sizes: {Path(args.sizes) / 'sizes.json'}: " + ", ".join(
            f"{e['size']} {e['status']} ({e['wall_seconds']} s)" for e in sizes["sizes"]))
        return 0
    if not args.run_dir:
        parser.error("a run directory, or --sizes OUT")
    result = compare(args.run_dir)
    print(json.dumps(json_ready(result), indent=1) if args.json else format_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
