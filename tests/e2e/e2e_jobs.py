"""Helpers for the learning tests: run a tiny job with `restage run`, read log.h5, evaluate saved HF checkpoints.

Evaluation goes through `transformers` on the checkpoint's `hf/` directory, so what is measured
is what a user would load, and it is independent of restage's own decoder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from restage.algorithms import packed_ops
from restage.config.load import load_config
from restage.data.batch import Batch
from restage.data.datasets import load_splits
from restage.demo import ensure_tiny_model
from restage.report.log import read_log

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "results" / "assets" / "tiny-llama"

# Layouts that put parameter reallocation inside the learning loop: the actor generates with
# dp2 and trains with tp2 (every step moves its parameters from the tp2 shards to the dp2 copies).
RELAYOUT = {"actor_gen": "ranks:0-1 dp2", "actor_train": "ranks:0-1 tp2", "ref_inf": "ranks:0-1 dp2",
            "critic_inf": "ranks:0-1 dp2", "critic_train": "ranks:0-1 dp2"}


@dataclass(frozen=True)
class Run:
    trial_dir: Path
    seconds: float  # wall time of the whole `restage run` (planning, start-up, training, checkpoint)

    def stat(self, name: str) -> np.ndarray:
        """The per-step values of one logged statistic, in step order."""
        series = read_log(self.trial_dir).stat_series()
        assert name in series, f"{name} not logged; have {sorted(series)}"
        return series[name][1]

    def checkpoint(self, model: str) -> Path:
        from restage.runtime.checkpoint.checkpoint_dir import latest

        found = latest(self.trial_dir)
        assert found is not None, f"no checkpoint under {self.trial_dir}"
        return found / model / "hf"


def tiny_model() -> Path:
    return ensure_tiny_model(ROOT)


def layout_overrides(layouts: dict[str, str], mfcs: tuple[str, ...]) -> list[str]:
    return ["plan.mode=manual", *[f"plan.layouts.{m}={layouts[m]}" for m in mfcs]]


def restage_run(results: Path, job: str, nprocs: int, trial: str, *overrides: str, timeout: float = 600) -> Run:
    """`restage run jobs/<job>.yaml -n nprocs` from the repository root, results under ``results``."""
    tiny_model()
    command = [sys.executable, "-m", "restage.cli", "run", f"jobs/{job}.yaml", "-n", str(nprocs), f"trial={trial}",
               f"run.results_dir={results}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    started = time.time()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.time() - started
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    experiment = load_config(ROOT / "jobs" / f"{job}.yaml").experiment
    return Run(results / experiment / trial, seconds)


def held_out(job: str, limit: int = 0) -> Batch:
    """The held-out split of a job's data set (``dataset.eval_fraction``), as one packed batch."""
    cfg = load_config(ROOT / "jobs" / f"{job}.yaml")
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        _, evaluation = load_splits(cfg)
    finally:
        os.chdir(cwd)
    assert len(evaluation) > 0, f"{job} holds no evaluation split"
    return evaluation.batch(list(range(limit or len(evaluation))))


def _padded(batch: Batch, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``[n, width]`` ids (pad 0) and attention mask of a packed key."""
    n, width = batch.n_seqs, max(batch.seqlens)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, seq in enumerate(torch.split(batch[key], list(batch.seqlens))):
        ids[i, :len(seq)] = seq
        mask[i, :len(seq)] = 1
    return ids, mask


@torch.no_grad()
def reward_scores(hf_dir: Path, batch: Batch, key: str) -> torch.Tensor:
    """One score per sequence from a saved reward model (HF sequence classification: the last real token)."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    ids, mask = _padded(batch, key)
    return model(input_ids=ids, attention_mask=mask).logits[:, 0].float()


@torch.no_grad()
def answer_logprobs(hf_dir: Path, batch: Batch, key: str) -> torch.Tensor:
    """``[T]`` packed log p(token | prefix) of a saved causal LM, 0 on prompt tokens."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    ids, mask = _padded(batch, key)
    logits = model(input_ids=ids, attention_mask=mask).logits[mask.bool()].float()
    logprobs = packed_ops.token_logprobs(logits, batch[key], batch.cu_seqlens)
    return logprobs * (~batch["prompt_mask"].bool())


def pair_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Fraction of pairs with chosen > rejected; ties count one half (as restage's own accuracy stats)."""
    return float(((chosen > rejected).float() + 0.5 * (chosen == rejected).float()).mean())


# Async mode's tests: generation on rank 1, everything else on rank 0 (the actor trains there: its home).
ASYNC_SPLIT = {"actor_gen": "ranks:1-1 dp1", "actor_greedy_gen": "ranks:1-1 dp1", "ref_inf": "ranks:0-0 dp1",
         "actor_prox": "ranks:0-0 dp1", "actor_train": "ranks:0-0 dp1", "critic_inf": "ranks:0-0 dp1",
         "critic_train": "ranks:0-0 dp1"}
GRPO_MFCS = ("actor_gen", "ref_inf", "actor_prox", "actor_train")
PPO_MFCS = ("actor_gen", "ref_inf", "critic_inf", "actor_prox", "actor_train", "critic_train")
REMAX_MFCS = ("actor_gen", "actor_greedy_gen", "ref_inf", "actor_prox", "actor_train")


def report(name: str, **figures) -> None:
    """One line the test prints (run pytest with -s to see it): the figures the docs quote."""
    print(f"\nE2E {name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in figures.items()), flush=True)
