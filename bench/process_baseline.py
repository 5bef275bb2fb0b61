"""The memory a rank process holds before its plan puts anything on the device: the process baseline.

    python bench/process_baseline.py [--json] [--device cpu|cuda]

The runtime's peak memory (``runtime/clock.peak_memory_bytes``) is, on a GPU, PyTorch's
``max_memory_allocated`` plus the device memory in use outside PyTorch's allocator (CUDA context,
cuBLAS and NCCL state); on a CPU, the process's peak resident set. The estimator predicts only what
the plan puts there (weights, optimizer state, activations, KV cache), so for a tiny model it
predicts ~0 where the runtime measures the process itself. This script measures that process
baseline stage by stage in a fresh process, with the runtime's own measure:

* cuda: the context alone (one small tensor); then a bf16 matmul (cuBLAS handle and workspace) and
  a scaled-dot-product attention; then a one-rank NCCL communicator and an all-reduce on it; then
  one AdamW step of a 1M-parameter MLP (its own bytes, counted, are subtracted).
* cpu: ``import torch``; then DeepSpeed and the runtime's modules (what a rank of ``restage run``
  imports); then a one-rank gloo group.

The figures go into ``restage/accuracy.py`` (``PROCESS_BASELINES``) by hand, with the command, the
machine and the versions.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

START_RSS_BYTES = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # before torch is imported


def _cuda_stages() -> list[dict]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    device = torch.device("cuda", 0)
    out = []

    def mark(stage: str, own_bytes: int = 0) -> None:
        torch.cuda.synchronize(device)
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        outside = max(0, (total_bytes - free_bytes) - torch.cuda.memory_reserved(device))
        peak = torch.cuda.max_memory_allocated(device)
        out.append({"stage": stage, "allocated_bytes": torch.cuda.memory_allocated(device),
                    "max_allocated_bytes": peak, "reserved_bytes": torch.cuda.memory_reserved(device),
                    "outside_allocator_bytes": outside, "runtime_measure_bytes": peak + outside,
                    "own_bytes": own_bytes, "baseline_bytes": peak + outside - own_bytes})

    torch.zeros(1, device=device)
    mark("context")
    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()
    q = torch.randn(1, 4, 128, 64, device=device, dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().item()
    del a, q
    mark("cublas+attention")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=0, world_size=1, device_id=device)
        t = torch.ones(1 << 20, device=device)
        dist.all_reduce(t)
        del t
        mark("nccl")
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).to(device)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(64, 512, device=device)
        model(x).square().mean().backward()
        optim.step()
        params = sum(p.numel() for p in model.parameters())
        own = params * 4 * 4 + x.numel() * 4 * 4  # fp32 params, grads, m, v; input and activations (counted loosely)
        mark("adamw step (1.05M params)", own)
        dist.destroy_process_group()
    return out


def _cpu_stages() -> list[dict]:
    out = []

    def mark(stage: str, rss_bytes: int | None = None) -> None:
        rss = rss_bytes or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        out.append({"stage": stage, "peak_rss_bytes": rss, "baseline_bytes": rss})

    mark("interpreter", START_RSS_BYTES)
    import torch
    import torch.distributed as dist

    torch.ones(1)
    mark("import torch")
    import deepspeed  # noqa: F401  (what a rank imports to build its engines)


    mark("import deepspeed, restage.runtime.step.worker")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        t = torch.ones(1 << 10)
        dist.all_reduce(t)
        mark("gloo group")
        dist.destroy_process_group()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    args = parser.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stages = _cuda_stages() if device == "cuda" else _cpu_stages()
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "stages": stages}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    for s in stages:
        print(f"  {s['stage']:<45} baseline {s['baseline_bytes'] / 2**30:6.3f} GiB  "
              + "  ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in s.items() if k.endswith("_bytes") and k != "baseline_bytes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
