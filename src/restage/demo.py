"""``make demo``: build the tiny assets, run a small PPO job on CPU with reallocation, report it.

The job is jobs/ppo_tiny.yaml on 2 ranks with a manual plan that generates with the actor in a
different layout (dp2) from the one it trains in (tp2), so parameter reallocation is in the loop.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from restage.models.tiny import build_tiny

ASSETS = Path("results/assets")
TOKENIZER = Path("data/synthetic/tokenizer")


def ensure_tiny_model(root: Path = Path("."), seed: int = 0) -> Path:
    """A random tiny LLaMA over the synthetic task's 16-token vocabulary, with that tokenizer (built once).

    ``root`` is the repository the shipped jobs run from (default: the working directory); the
    model is ``root/results/assets/tiny-llama``, the path that is returned.
    """
    return _ensure_sort_model(root / ASSETS / "tiny-llama", root, seed, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64)


def ensure_llama_256x4(root: Path = Path("."), seed: int = 0) -> Path:
    """A random 256-wide, 4-layer LLaMA (about 3M parameters) over the same vocabulary and tokenizer, room for
    64-token answers (jobs/grpo_256x4.yaml, bench/e2e_cpu.py's larger job); ``root/results/assets/llama-256x4``."""
    return _ensure_sort_model(root / ASSETS / "llama-256x4", root, seed, hidden_size=256, intermediate_size=688,
                              num_layers=4, num_heads=8, num_kv_heads=4, max_positions=128)


def ensure_arith_model(root: Path = Path("."), seed: int = 0) -> Path:
    """A random tiny LLaMA over the calculator task's 24-token vocabulary (``restage.data.arith``) with that tokenizer
    (jobs/grpo_calculator_tiny.yaml), built once: ``root/results/assets/tiny-llama-arith``."""
    path = root / ASSETS / "tiny-llama-arith"
    if (path / "config.json").is_file():
        return path
    from restage.data import arith

    tokenizer = root / arith.DEFAULT_DIR / "tokenizer"
    if not tokenizer.is_dir():
        arith.make(root / arith.DEFAULT_DIR)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(tmp, family="llama", seed=seed, vocab_size=len(arith.VOCAB), tokenizer=False, hidden_size=64,
               intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64)
    for file in tokenizer.iterdir():
        shutil.copy(file, tmp / file.name)
    tmp.replace(path)
    return path


# The model of jobs/gpu_ppo_300m.yaml (scripts/gpu_check.sh's `costs` part): a random LLaMA of about 300M parameters
# over the sort vocabulary, wide enough that a GPU's GEMMs, not kernel launches, dominate its training passes.
LLAMA_300M_SIZES = dict(hidden_size=1536, intermediate_size=4096, num_layers=12, num_heads=12, num_kv_heads=4,
                        max_positions=512)


def ensure_llama_300m(root: Path = Path("."), seed: int = 0) -> Path:
    """The random ~300M LLaMA of jobs/gpu_ppo_300m.yaml (``LLAMA_300M_SIZES``, bf16 weights, 0.6 GB) over the sort
    vocabulary and tokenizer, built once; ``root/results/assets/llama-300m``."""
    return _ensure_sort_model(root / ASSETS / "llama-300m", root, seed, dtype=torch.bfloat16, **LLAMA_300M_SIZES)


# The model of jobs/gpu_grpo_1b.yaml (bench/gpu_limits.py's GRPO step, scripts/gpu_check.sh's `limits` part): a random
# 1B-class LLaMA (about 0.97B parameters over the sort vocabulary); bench/gpu_limits.py's decode, prefill and training
# figures take the same backbone over a 32,000-token vocabulary.
LLAMA_1B_SIZES = dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
                      max_positions=4096)


def ensure_llama_1b(root: Path = Path("."), seed: int = 0) -> Path:
    """The random 1B-class LLaMA of jobs/gpu_grpo_1b.yaml (``LLAMA_1B_SIZES``, bf16 weights, 1.9 GB) over the sort
    vocabulary and tokenizer, built once; ``root/results/assets/llama-1b``."""
    return _ensure_sort_model(root / ASSETS / "llama-1b", root, seed, dtype=torch.bfloat16, **LLAMA_1B_SIZES)


# The models of scripts/gpu_check.sh's `sizes` part (issue 30 item 3: restage's own measurements per MFC on one GPU
# at three sizes; jobs/gpu_ppo_0p5b.yaml, gpu_ppo_1p5b.yaml, gpu_grpo_4b.yaml): random LLaMA-family decoders of Qwen
# widths and depths, bf16, over the sort vocabulary (its 16 tokens add almost nothing, so the parameters are the
# blocks'). 0p5b: Qwen3-0.6B's hidden 1024 with 32 layers, MLP 4096, 16 heads, 4 KV heads (0.49B); 1p5b:
# Qwen2.5-1.5B's hidden 1536, MLP 8960, 12 heads, 2 KV heads, with 32 layers (1.50B); 4b: Qwen3-4B's hidden 2560 and
# 20 heads of 128, 4 KV heads, MLP 11008, 40 layers (4.01B). Each head is hidden / heads wide (restage's LLaMA
# blocks), so Qwen3's wider q projection is not copied.
GPU_SIZE_MODELS = {
    "0p5b": dict(hidden_size=1024, intermediate_size=4096, num_layers=32, num_heads=16, num_kv_heads=4,
                 max_positions=512),
    "1p5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=32, num_heads=12, num_kv_heads=2,
                 max_positions=512),
    "4b": dict(hidden_size=2560, intermediate_size=11008, num_layers=40, num_heads=20, num_kv_heads=4,
               max_positions=512),
}
# `sizes-cpu`'s stand-ins: the same jobs on a CPU over tiny widths (fp32), to check the part's paths and files.
CPU_SIZE_MODELS = {
    "0p5b": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64),
    "1p5b": dict(hidden_size=96, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64),
    "4b": dict(hidden_size=128, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=2, max_positions=64),
}


def ensure_size_model(size: str, cpu: bool = False, root: Path = Path("."), seed: int = 0) -> Path:
    """The random model of ``sizes``' job for ``size`` (a key of ``GPU_SIZE_MODELS``), built once:
    ``root/results/assets/llama-<size>`` in bf16, or with ``cpu`` the tiny fp32 stand-in ``tiny-llama-<size>``."""
    if cpu:
        return _ensure_sort_model(root / ASSETS / f"tiny-llama-{size}", root, seed, dtype=torch.float32,
                                  **CPU_SIZE_MODELS[size])
    return _ensure_sort_model(root / ASSETS / f"llama-{size}", root, seed, dtype=torch.bfloat16,
                              **GPU_SIZE_MODELS[size])


def _ensure_sort_model(path: Path, root: Path, seed: int, *, hidden_size: int, intermediate_size: int, num_layers: int,
                       num_heads: int, num_kv_heads: int, max_positions: int, dtype: torch.dtype = torch.float32) -> Path:
    """A random LLaMA of these sizes over the 16-token sort vocabulary at ``path``, built once (whole or absent)."""
    if (path / "config.json").is_file():
        return path

    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(tmp, family="llama", seed=seed, vocab_size=16, tokenizer=False, hidden_size=hidden_size,
               intermediate_size=intermediate_size, num_layers=num_layers, num_heads=num_heads,
               num_kv_heads=num_kv_heads, max_positions=max_positions, dtype=dtype)
    for file in (root / TOKENIZER).iterdir():
        shutil.copy(file, tmp / file.name)
    tmp.replace(path)
    return path


DEMO_ARGS = ["jobs/ppo_tiny.yaml", "-n", "2", "trial=demo", "run.steps=8", "run.save_every=4",
             "plan.mode=manual",
             "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
             "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2",
             "plan.layouts.critic_train=ranks:0-1 dp2"]


def main() -> int:
    ensure_tiny_model()
    run = subprocess.run([sys.executable, "-m", "restage.cli", "run", *DEMO_ARGS, "--overwrite"])
    if run.returncode != 0:
        return run.returncode
    trial = Path("results/ppo-tiny/demo")
    report = subprocess.run([sys.executable, "-m", "restage.cli", "report", str(trial), "--png", str(trial / "report")])
    if report.returncode != 0:
        return report.returncode
    print(f"\nreport: {trial / 'report'} (PNG plots), log: {trial / 'log.h5'}, "
          f"checkpoints: {trial / 'checkpoints'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
