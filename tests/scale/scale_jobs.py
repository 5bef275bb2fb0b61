"""The scale matrix's job, its one-rank reference and the comparison, shared by the matrix and the fuzzer.

The job is PPO (actor, critic, reference; sampled answers, each request seeded by its sample's id, so alike in
every layout) on models big enough for every layout class at 8 and 16
ranks: 4 layers, 8 attention heads and 4 key-value heads (tp up to 4, pp up to 4). Its prompts all have the same
length and every answer runs to ``max_new_tokens`` (``min_new_tokens`` equals it), the PPO update is one
minibatch per epoch, and early stopping is off (it trips on one micro-batch's mean ratio, so where the batch is cut
decides it). Then every sample carries the same number of answer tokens, so the per-micro-batch token means
that data-parallel training averages (DeepSpeed's mean over dp of the mean over micro-batches, as verl and OpenRLHF
aggregate too) equal the one-rank mean exactly, and a run at any layout must equal the one-rank run up to the order
of floating-point sums. What "equal" allows is ``WEIGHT_RTOL`` / ``STAT_RTOL`` below; a broken layout (a gradient
not averaged, a shard left out, a stage's parameters not updated) moves the weights by orders of magnitude more.
Losses divide by the optimizer step's counts (``execute.loss_norm``), so answers of different lengths would train
to the same weights too, but the logged statistics are each micro-batch's own means and would differ.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2
BATCH = 16
ANSWER = 7
# Float noise of a layout change after 2 PPO steps (measured: at most ~1e-6 whole-model, see the note in the matrix
# test); the bound leaves room for reduction orders and is ~1e4 times below what one missing gradient shard gives.
WEIGHT_RTOL = 2e-5
STAT_RTOL, STAT_ATOL = 1e-4, 1e-6
# Statistics that measure the run, not the training: they differ between layouts by design.
# A mixture's router statistics depend on how the batch was cut into micro-batches: the busiest and idlest expert's
# share of one micro-batch's tokens, and the load-balancing loss, a product of two of its means (the job sets its
# coefficient to 0, so it moves no weight; the weights are compared).
NOT_COMPARED = ("seconds", "samples_per_second", "tokens_per_second", "mfu", "memory", "throughput", "timing",
                "/router/")
MODELS = ("actor", "critic", "ref")
TRAINED = ("actor", "critic")
MFCS = ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")


def scale_assets(where: Path) -> tuple[Path, Path, Path]:
    """(dense model, mixture-of-experts model, fixed-length prompts) under ``where``, made once."""
    from restage.models.tiny import build_tiny

    dense, moe, prompts = where / "dense", where / "moe", where / "prompts.jsonl"
    tokenizer = ROOT / "data" / "synthetic" / "tokenizer"
    for path, family, extra in ((dense, "llama", {}),
                                (moe, "mixtral", {"intermediate_size": 48, "router_aux_loss_coef": 0.0})):
        if not (path / "config.json").exists():
            sizes = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 4, "num_heads": 8,
                     "num_kv_heads": 4, "max_positions": 64, **extra}
            build_tiny(path, family=family, vocab_size=16, tokenizer=False, **sizes)
            for file in tokenizer.iterdir():
                shutil.copy(file, path / file.name)
    if not prompts.exists():
        rows = [line for line in (ROOT / "data" / "synthetic" / "prompts.jsonl").read_text().splitlines()
                if len(json.loads(line)["prompt"].split()) == 7]
        prompts.write_text("\n".join(rows) + "\n")
    return dense, moe, prompts


@dataclass(frozen=True)
class Case:
    """One run of the matrix: layouts per MFC (``ranks:A-B dpXtpYppZ``), ZeRO stage of the trained models."""

    name: str
    nprocs: int
    layouts: dict[str, str]
    zero: int = 1
    moe: bool = False
    nodes: int = 1
    extra: tuple[str, ...] = field(default=())

    def overrides(self) -> list[str]:
        return ["plan.mode=manual", *[f"plan.layouts.{m}={v}" for m, v in self.layouts.items()],
                *[f"models.{m}.zero_stage={self.zero}" for m in TRAINED], *self.extra]


def job_args(assets: tuple[Path, Path, Path], moe: bool = False) -> list[str]:
    dense, mixture, prompts = assets
    actor = mixture if moe else dense
    return ["jobs/ppo_tiny.yaml", f"run.steps={STEPS}", f"run.batch_size={BATCH}", "run.micro_batches=2",
            "run.save_every=0", "generation.temperature=1.0", f"generation.max_new_tokens={ANSWER}",
            f"generation.min_new_tokens={ANSWER}", f"dataset.max_answer_tokens={ANSWER}", f"dataset.path={prompts}",
            "algo.minibatches=1", "algo.ppo_epochs=2", "algo.early_stop_ratio=0", f"models.actor.path={actor}",
            f"models.ref.path={actor}", f"models.critic.path={dense}"]


def run(results: Path, trial: str, nprocs: int, args: list[str], timeout: float = 1500,
        env: dict | None = None) -> Path:
    """``restage run`` of ``args`` on ``nprocs`` local ranks; returns the trial directory (asserts success)."""
    command = [sys.executable, "-m", "restage.cli", "run", *args, "-n", str(nprocs), f"run.nprocs={nprocs}",
               f"trial={trial}", f"run.results_dir={results}"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{trial} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return results / "ppo-tiny" / trial


def reference(results: Path, assets: tuple[Path, Path, Path], moe: bool = False, lora: tuple[str, ...] = ()) -> Path:
    """The one-rank run of the job (made once per results directory, kind of actor and LoRA overrides)."""
    trial = "one-rank" + ("-moe" if moe else "") + ("-lora" if lora else "")
    done = results / "ppo-tiny" / trial / "checkpoints"
    if done.is_dir() and any(done.glob("step-*")):
        return results / "ppo-tiny" / trial
    layouts = [f"plan.layouts.{m}=ranks:0 dp1" for m in MFCS]
    return run(results, trial, 1, [*job_args(assets, moe), "plan.mode=manual", *layouts, *lora])


def _weights(trial: Path, model: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from restage.runtime.checkpoint.checkpoint_dir import latest

    checkpoint = latest(trial)
    assert checkpoint is not None, f"no checkpoint under {trial}"
    out: dict[str, torch.Tensor] = {}
    # A LoRA model's checkpoint holds its adapters (the base is frozen), a dense one its whole HF weights.
    where = checkpoint / model / ("adapter" if (checkpoint / model / "adapter").is_dir() else "hf")
    for file in sorted(where.glob("*.safetensors")):
        out.update(load_file(file))
    assert out, f"no weights for {model} in {checkpoint}"
    return out


@dataclass(frozen=True)
class Difference:
    """How far a run is from the one-rank run: the largest whole-model relative weight difference and the largest
    relative difference of a logged statistic (with their names); a ``*_fraction`` statistic may differ by one
    answer token's share."""

    weights: float
    weights_model: str
    stat: float
    stat_name: str
    steps: int

    def within(self) -> bool:
        return self.weights <= WEIGHT_RTOL and self.stat <= 1.0 and self.steps == STEPS

    def as_json(self) -> dict:
        return {"weights_rel": self.weights, "weights_model": self.weights_model, "stat_excess": self.stat,
                "stat_name": self.stat_name, "steps": self.steps}


def difference(trial: Path, ref: Path) -> Difference:
    """Compare a run with the one-rank run: every trained model's final weights (whole-model relative norm of the
    difference), and every logged statistic both have at every step, as a multiple of the allowed
    ``STAT_ATOL + STAT_RTOL * |reference|`` (<= 1 passes)."""
    from restage.report.log import read_log

    worst_w, worst_model = 0.0, ""
    for model in TRAINED:
        mine, theirs = _weights(trial, model), _weights(ref, model)
        assert mine.keys() == theirs.keys(), f"{model}: tensor names differ"
        a = torch.cat([mine[n].double().flatten() for n in sorted(mine)])
        b = torch.cat([theirs[n].double().flatten() for n in sorted(theirs)])
        rel = float((a - b).norm() / b.norm())
        if rel >= worst_w:
            worst_w, worst_model = rel, model
    log, ref_log = read_log(trial), read_log(ref)
    mine_s, theirs_s = log.stat_series(), ref_log.stat_series()
    worst_s, worst_name = 0.0, ""
    compared = 0
    for name, (steps, values) in theirs_s.items():
        if name not in mine_s or any(word in name for word in NOT_COMPARED):
            continue
        m_steps, m_values = mine_s[name]
        assert list(m_steps) == list(steps), f"{name}: logged at steps {list(m_steps)}, one rank at {list(steps)}"
        atol = STAT_ATOL
        if name.endswith("_fraction"):
            # A share of tokens past a threshold (a clip): float noise may move one token across it.
            atol = 1.0 / float(theirs_s[name.split("/")[0] + "/answer_tokens"][1].min())
        excess = np.abs(m_values - values) / (atol + STAT_RTOL * np.abs(values))
        compared += 1
        if float(excess.max()) >= worst_s:
            worst_s, worst_name = float(excess.max()), name
    assert compared >= 8, f"only {compared} statistics in common with the one-rank run"
    return Difference(worst_w, worst_model, worst_s, worst_name, int(log.last_complete_step))


def record(case: str, nodes: int, zero: int, diff: Difference | None, error: str = "") -> None:
    """Append the case's result to ``$RESTAGE_SCALE_REPORT`` (JSON lines) when set: the table in the issue note."""
    path = os.environ.get("RESTAGE_SCALE_REPORT")
    if not path:
        return
    row = {"case": case, "nodes": nodes, "zero": zero, "pass": bool(diff and diff.within()),
           **(diff.as_json() if diff else {}), **({"error": error[-300:]} if error else {})}
    with open(path, "a") as out:
        out.write(json.dumps(row) + "\n")
