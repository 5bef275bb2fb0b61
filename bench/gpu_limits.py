"""How close restage runs to one GPU's limits (issue 29 item 4), for a 1B-class LLaMA, as one JSON.

    python bench/gpu_limits.py [--device cuda|cpu] [--dtype bf16|fp32] [--size 1b|tiny] [--cluster NAME] [--json]
                               [--out FILE]

Four parts, in this order, each with a time budget (``BUDGET_SECONDS``: it starts no new case once its budget is
spent and says ``truncated``), so that the whole fits 8 minutes on one H100 or H200:

* ``decode``: the rollout engine (``RolloutEngine``, contiguous slots and the paged cache, ``RolloutLimits.paged``)
  on ``concurrency`` = 32, 128 and 512 requests of ``prompt_tokens`` (64) random tokens, each answer exactly
  ``answer_tokens`` (256) long (no EOS id, ``min_new_tokens = max_new_tokens``), sampled at temperature 1, as many
  slots as requests. Each case is timed as a whole run and as a run of one answer token (prefill and the first
  decode step); their difference is the other 255 decode steps, whose roofline is the HBM traffic they cannot avoid:
  every weight matrix once a step plus, for each sequence, the keys and values of every position it attends to,
  ``(prompt_tokens + j)`` at answer step ``j`` (``decode_bytes``: the KV bytes grow by one position a step, summed
  over the steps). ``roofline_fraction`` = those bytes / the cluster's peak HBM bandwidth / the measured seconds.
* ``prefill``: a run of one answer token over long prompts (and the decode cases' 64-token prompts at the largest
  concurrency): prompt tokens / second and the forward's FLOPs over the cluster's peak (the engine prefills all
  but a prompt's last token; the seconds hold one eager decode step too).
* ``train``: forward, backward (``train_1f1b``) and an AdamW step of the same model in the same dtype over packed
  sequences of ``prompt_tokens + answer_tokens`` tokens with a policy-gradient loss on their log-probabilities;
  MFU = 3 x the forward's FLOPs (``models.flops.forward_flops``: 2 per matrix parameter and token, causal
  attention, the LM head) / seconds / peak FLOP/s.
* ``grpo``: a whole GRPO job on one rank (``jobs/gpu_grpo_1b.yaml``: the same backbone over the sort task's
  16-token vocabulary, 16 prompts x 8 answers of 256 tokens) run by ``restage run``, then its measured seconds per
  MFC and per step set beside the estimator's prediction for the same plan (``bench/runtime_vs_estimate.py``), and
  actor_train's MFU as the runtime counts its FLOPs.

Targets (reported, not asserted; ``TARGETS``): decode at least 70% of the HBM roofline at 128 or more concurrent
sequences; training at least 40% MFU in bf16; the GRPO step within 15% of the estimate. Peak FLOP/s and bandwidth
are the cluster file's (``--cluster``; default from the device's name as scripts/gpu_check.sh's ``costs`` takes
it, ``local-cpu`` on a CPU). ``--size tiny --device cpu --dtype fp32`` is a dry run of every path and of the JSON's
shape (jobs/grpo_tiny.yaml for the GRPO step): its figures say nothing about a GPU. ``--out FILE`` rewrites FILE
after each part, so a run cut short keeps the parts it finished. ``scripts/gpu_check.sh OUT limits`` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

import restage.demo
from restage.cluster import ClusterSpec, load_cluster
from restage.config.load import load_config
from restage.device import DTYPES
from restage.models.arch import ModelConfig
from restage.models.decoder import StageModule
from restage.models.flops import attended_tokens, block_shape, forward_flops
from restage.models.packing import pack
from restage.models.parallel import ParallelContext
from restage.models.pipeline import MicroBatch, train_1f1b
from restage.plan.compute import DTYPE_BYTES
from restage.rollout.budget import RolloutLimits, kv_bytes_per_slot
from restage.rollout.engine import RolloutEngine
from restage.rollout.sampling import SamplingParams, request_keys, request_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_vs_estimate import compare  # noqa: E402  (bench/ is not a package)

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"decode_roofline_fraction": 0.70, "decode_min_concurrency": 128, "train_mfu": 0.40,
           "grpo_step_abs_error_percent": 15.0}
# Seconds each part may start new cases in (the GRPO step: model build, run and comparison), 450 s in all: the
# whole stays under 8 minutes (scripts/gpu_check.sh's timeout) with the imports and the model's set-up.
BUDGET_SECONDS = {"decode": 120.0, "prefill": 30.0, "train": 60.0, "grpo": 240.0}
TRAIN_STEPS = 3  # timed, after one warm-up step; the median counts


@dataclass(frozen=True)
class Workload:
    """What one ``--size`` measures."""

    arch: ModelConfig  # the model of decode, prefill and train
    concurrency: tuple[int, ...]
    prompt_tokens: int
    answer_tokens: int
    prefill_prompts: int  # the long-prompt prefill case: this many prompts of prefill_tokens
    prefill_tokens: int
    train_micro_batches: int
    train_sequences: int  # per micro-batch, each prompt_tokens + answer_tokens long
    job: str  # the GRPO job, relative to the repository
    job_model: str  # the restage.demo function that builds the job's model
    job_steps: int
    job_cluster: str | None  # the cluster the job is costed as; None: the bench's
    timed_runs: int = 2  # per decode or prefill case, after warm_up_runs; the fastest counts
    warm_up_runs: int = 1


def _llama(vocab: int, **sizes) -> ModelConfig:
    return ModelConfig(family="llama", model_type="llama", vocab_size=vocab, hidden_size=sizes["hidden_size"],
                       intermediate_size=sizes["intermediate_size"], num_layers=sizes["num_layers"],
                       num_heads=sizes["num_heads"], num_kv_heads=sizes["num_kv_heads"],
                       max_positions=sizes["max_positions"], norm_eps=1e-5)


WORKLOADS = {
    # The job's backbone (restage.demo.LLAMA_1B_SIZES) over a 32,000-token vocabulary: 1.10B parameters.
    "1b": Workload(arch=_llama(32000, **restage.demo.LLAMA_1B_SIZES), concurrency=(32, 128, 512), prompt_tokens=64,
                   answer_tokens=256, prefill_prompts=64, prefill_tokens=1024, train_micro_batches=4,
                   train_sequences=24, job="jobs/gpu_grpo_1b.yaml", job_model="ensure_llama_1b", job_steps=6,
                   job_cluster=None),
    # The CPU dry run: the same concurrencies, short prompts and answers (a CPU decodes 512 sequences at 0.1-0.4 s a
    # step), one run per case and no warm-up, two GRPO steps.
    "tiny": Workload(arch=_llama(512, hidden_size=64, intermediate_size=172, num_layers=2, num_heads=4, num_kv_heads=2,
                                 max_positions=1024),
                     concurrency=(32, 128, 512), prompt_tokens=8, answer_tokens=8, prefill_prompts=16,
                     prefill_tokens=256, train_micro_batches=2, train_sequences=4, job="jobs/grpo_tiny.yaml",
                     job_model="ensure_tiny_model", job_steps=2, job_cluster="local-cpu", timed_runs=1, warm_up_runs=0),
}


# ---- the arithmetic (tests/plan/test_gpu_limits_bench_on_cpu.py checks it by hand) ----

def weight_bytes(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of the weight matrices a decode step reads once each: every block's and the LM head (the embedding
    table gives one row per sequence, and the norms are vectors: both left out)."""
    s = block_shape(cfg, 1)
    return (cfg.num_layers * s.weight_params + s.head_out * s.hidden) * DTYPE_BYTES[dtype]


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """Bytes of one position's keys and values over all layers."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class DecodeTraffic:
    """The HBM bytes decode steps cannot avoid reading."""

    weight_bytes: int
    kv_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes


def decode_bytes(weights: int, kv_per_token: int, sequences: int, prompt_tokens: int, first_step: int,
                 steps: int) -> DecodeTraffic:
    """Answer steps ``first_step .. first_step + steps - 1`` of ``sequences`` decoding together: the weights once a
    step; at answer step ``j`` each sequence's keys and values for the ``prompt_tokens + j`` positions it attends to
    (its last prompt token is answer step 0's input, and the new position is written and read in its step)."""
    positions = steps * prompt_tokens + steps * (2 * first_step + steps - 1) // 2  # sum of prompt_tokens + j
    return DecodeTraffic(weight_bytes=steps * weights, kv_bytes=sequences * positions * kv_per_token)


def roofline_fraction(nbytes: float, bytes_per_second: float, seconds: float) -> float:
    """The time ``nbytes`` take at ``bytes_per_second`` over the time measured."""
    return nbytes / bytes_per_second / seconds


def train_flops(cfg: ModelConfig, sequences: int, seq_tokens: int) -> float:
    """A training pass (forward and backward: three forwards) over ``sequences`` packed sequences of ``seq_tokens``."""
    return 3 * forward_flops(cfg, sequences * seq_tokens, attended_tokens(seq_tokens, cfg.sliding_window))


def prefill_flops(cfg: ModelConfig, sequences: int, tokens: int) -> float:
    """A prefill of ``sequences`` prompts of ``tokens`` each (no logits: the engine selects no position)."""
    return forward_flops(cfg, sequences * tokens, attended_tokens(tokens, cfg.sliding_window), head_tokens=0)


def mfu(flops: float, seconds: float, peak_flops_per_second: float) -> float:
    return flops / seconds / peak_flops_per_second


# ---- measuring ----

class Clock:
    """Seconds since the bench started, and progress lines on stderr."""

    def __init__(self) -> None:
        self.started = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.started

    def say(self, line: str) -> None:
        print(f"[gpu_limits {self.now():6.1f} s] {line}", file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> StageModule:
    """The model on one rank, its matrices N(0, 0.02) and its norms 1 (the figures here do not depend on the values)."""
    torch.manual_seed(seed)
    module = StageModule(cfg, ParallelContext.single(), dtype, device)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)
    return module


def random_prompts(count: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, tokens), generator=generator).tolist()


def run_engine(module: StageModule, prompts: list[list[int]], answer_tokens: int, limits: RolloutLimits,
               cuda_graphs: bool = True) -> tuple[float, RolloutEngine, torch.Tensor]:
    """One rollout (the engine built outside the timing: its cache allocation is not the decode's): seconds, the
    engine, the answers' lengths."""
    params = SamplingParams(max_new_tokens=answer_tokens, min_new_tokens=answer_tokens, temperature=1.0,
                            eos_token_ids=(), cuda_graphs=cuda_graphs)
    keys = request_keys([request_seed(0, r) for r in range(len(prompts))])
    engine = RolloutEngine(module, prompts, range(len(prompts)), [answer_tokens] * len(prompts), keys, params, [],
                           limits)
    synchronize(engine.device)
    began = time.perf_counter()
    _, _, lengths = engine.run()
    synchronize(engine.device)
    return time.perf_counter() - began, engine, lengths


def fastest(w: Workload, fn) -> tuple[float, RolloutEngine, torch.Tensor]:
    """``w.warm_up_runs`` calls of ``fn``, then the fastest of ``w.timed_runs`` timed ones."""
    for _ in range(w.warm_up_runs):
        fn()
    return min((fn() for _ in range(w.timed_runs)), key=lambda result: result[0])


def limits_for(module: StageModule, paged: bool, sequences: int, max_len: int) -> RolloutLimits:
    """Room for every sequence at once (a quarter to spare for a paged cache's last blocks), one slot each."""
    budget = int(1.25 * sequences * kv_bytes_per_slot(module, max_len))
    return RolloutLimits(kv_cache_bytes=budget, max_slots=sequences, paged=paged, block_tokens=0)


def decode_part(module: StageModule, w: Workload, dtype: str, cluster: ClusterSpec, clock: Clock) -> dict:
    deadline = clock.now() + BUDGET_SECONDS["decode"]
    weights, kv_token = weight_bytes(w.arch, dtype), kv_bytes_per_token(w.arch, dtype)
    peak_bandwidth, achievable = cluster.memory_bandwidth_bytes_per_second, cluster.achievable_memory_bandwidth()
    cases, truncated = [], False
    for concurrency in w.concurrency:
        prompts = random_prompts(concurrency, w.prompt_tokens, w.arch.vocab_size, seed=concurrency)
        for paged in (True, False):
            if clock.now() > deadline:
                truncated = True
                continue
            limits = limits_for(module, paged, concurrency, w.prompt_tokens + w.answer_tokens)
            whole, engine, lengths = fastest(w, partial(run_engine, module, prompts, w.answer_tokens, limits))
            first, _, _ = fastest(w, partial(run_engine, module, prompts, 1, limits))
            steps = w.answer_tokens - 1
            traffic = decode_bytes(weights, kv_token, concurrency, w.prompt_tokens, first_step=1, steps=steps)
            seconds = whole - first
            timed = seconds > 0  # a CPU dry run's few steps may time below its one-token run: no rates then
            case = {"cache": "paged" if paged else "contiguous", "concurrency": concurrency,
                    "prompt_tokens": w.prompt_tokens, "answer_tokens": w.answer_tokens,
                    "cache_type": type(engine.cache).__name__, "slots": engine.num_slots,
                    "block_tokens": getattr(engine.cache, "block_tokens", None),
                    "decode_mode": engine.decode_mode, "decode_reason": engine.decode_reason,
                    "preempted": getattr(engine, "preempted", None),  # the paged engine counts its preemptions
                    "answers_full_length": bool((lengths == w.answer_tokens).all()),
                    "whole_seconds": whole, "first_token_seconds": first, "decode_steps": steps,
                    "decode_seconds": seconds, "tokens_per_second": concurrency * w.answer_tokens / whole,
                    "decode_tokens_per_second": concurrency * steps / seconds if timed else None,
                    "weight_bytes_per_step": weights, "kv_bytes_per_step_mean": traffic.kv_bytes / steps,
                    "bytes_read": traffic.total_bytes, "roofline_seconds": traffic.total_bytes / peak_bandwidth,
                    "achieved_bytes_per_second": traffic.total_bytes / seconds if timed else None,
                    "roofline_fraction": roofline_fraction(traffic.total_bytes, peak_bandwidth, seconds) if timed else None,
                    "achievable_roofline_fraction": (roofline_fraction(traffic.total_bytes, achievable, seconds)
                                                     if timed else None)}
            cases.append(case)
            clock.say(f"decode {case['cache']:<10} x{concurrency:<4} {case['decode_tokens_per_second'] or 0:10.0f} tok/s, "
                      f"{seconds / steps * 1e3:7.3f} ms/step, roofline fraction {case['roofline_fraction'] or 0:.3f} "
                      f"({engine.decode_mode}, {case['cache_type']})")
    return {"cases": cases, "truncated": truncated, "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_token,
            "bandwidth_bytes_per_second": peak_bandwidth, "achievable_bandwidth_bytes_per_second": achievable}


def prefill_part(module: StageModule, w: Workload, dtype: str, cluster: ClusterSpec, clock: Clock) -> dict:
    deadline = clock.now() + BUDGET_SECONDS["prefill"]
    peak = cluster.peak_flops_per_second(dtype)
    cases, truncated = [], False
    for prompts_count, tokens in ((max(w.concurrency), w.prompt_tokens), (w.prefill_prompts, w.prefill_tokens)):
        if clock.now() > deadline:
            truncated = True
            continue
        prompts = random_prompts(prompts_count, tokens, w.arch.vocab_size, seed=tokens)
        limits = limits_for(module, True, prompts_count, tokens + 1)
        seconds, engine, _ = fastest(w, partial(run_engine, module, prompts, 1, limits, cuda_graphs=False))
        prefilled = prompts_count * (tokens - 1)
        flops = prefill_flops(w.arch, prompts_count, tokens - 1)
        case = {"prompts": prompts_count, "prompt_tokens": tokens, "prefilled_tokens": prefilled, "seconds": seconds,
                "tokens_per_second": prefilled / seconds, "flops": flops, "mfu": mfu(flops, seconds, peak),
                "cache_type": type(engine.cache).__name__}
        cases.append(case)
        clock.say(f"prefill {prompts_count} x {tokens}: {case['tokens_per_second']:10.0f} tok/s, MFU {case['mfu']:.3f}")
    return {"cases": cases, "truncated": truncated, "peak_flops_per_second": peak}


def train_part(module: StageModule, w: Workload, dtype: str, cluster: ClusterSpec, clock: Clock) -> dict:
    deadline = clock.now() + BUDGET_SECONDS["train"]
    device = next(module.parameters()).device
    seq_tokens = w.prompt_tokens + w.answer_tokens
    generator = torch.Generator().manual_seed(1)
    micro_batches = []
    for _ in range(w.train_micro_batches):
        ids = torch.randint(3, w.arch.vocab_size, (w.train_sequences, seq_tokens), generator=generator)
        tokens, batch = pack(list(ids), device=device)
        advantages = torch.randn(tokens.numel(), generator=generator).to(device)
        micro_batches.append(MicroBatch(tokens, batch, advantages))
    total_tokens = w.train_micro_batches * w.train_sequences * seq_tokens

    def loss_fn(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:  # a policy gradient on the answers' log-probs
        logprobs = module.token_logprobs(logits, mb.tokens, mb.batch)
        return -(logprobs * mb.extra).sum() / total_tokens

    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-6, fused=device.type == "cuda")

    def step() -> float:
        synchronize(device)
        began = time.perf_counter()
        train_1f1b(module, micro_batches, loss_fn)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        return time.perf_counter() - began

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()  # warm-up: the optimizer's state, the allocator, kernel choice
    samples = []
    for _ in range(TRAIN_STEPS):
        if clock.now() > deadline:
            break
        samples.append(step())
    seconds = statistics.median(samples) if samples else None
    flops = train_flops(w.arch, w.train_micro_batches * w.train_sequences, seq_tokens)
    peak = cluster.peak_flops_per_second(dtype)
    result = {"micro_batches": w.train_micro_batches, "sequences_per_micro_batch": w.train_sequences,
              "sequence_tokens": seq_tokens, "tokens_per_step": total_tokens,
              "optimizer": "torch AdamW" + (" (fused)" if device.type == "cuda" else "") + f" over {dtype} parameters",
              "step_seconds": samples, "seconds": seconds, "flops_per_step": flops, "peak_flops_per_second": peak,
              "tokens_per_second": total_tokens / seconds if seconds else None,
              "mfu": mfu(flops, seconds, peak) if seconds else None, "truncated": len(samples) < TRAIN_STEPS,
              "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    clock.say(f"train {total_tokens} tokens a step: {result['tokens_per_second'] or 0:10.0f} tok/s, MFU "
              f"{result['mfu'] or 0:.3f}")
    return result


def grpo_part(w: Workload, cluster: ClusterSpec, clock: Clock, log_path: Path) -> dict:
    """The job on one rank, then its measured seconds against its schedule's predictions."""
    started = clock.now()
    deadline = started + BUDGET_SECONDS["grpo"]
    costed_as = w.job_cluster or cluster.name
    trial = "gpu-limits"
    model = getattr(restage.demo, w.job_model)(REPO)
    build_seconds = clock.now() - started
    clock.say(f"grpo: model {model} ready after {build_seconds:.1f} s; running {w.job} for {w.job_steps} steps, "
              f"costed as {costed_as}")
    job = load_config(REPO / w.job, [f"trial={trial}", f"cluster.name={costed_as}"])
    run_dir = job.trial_dir
    command = [sys.executable, "-m", "restage.cli", "run", w.job, "-n", "1", f"cluster.name={costed_as}",
               f"trial={trial}", f"run.steps={w.job_steps}", "--overwrite"]
    result = {"job": w.job, "model": str(model), "cluster": costed_as, "steps": w.job_steps, "run_dir": str(run_dir),
              "command": " ".join(["python", *command[1:]]), "model_build_seconds": build_seconds, "log": str(log_path)}
    with open(log_path, "w") as log:
        try:
            run = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                 timeout=max(1.0, deadline - clock.now()))
            result["returncode"] = run.returncode
        except subprocess.TimeoutExpired:
            result["returncode"] = None
            result["error"] = f"timed out after the part's {BUDGET_SECONDS['grpo']:.0f} s"
    result["run_seconds"] = clock.now() - started - build_seconds
    if result["returncode"] != 0:
        result.setdefault("error", f"restage run exited {result['returncode']}")
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-15:]
        clock.say(f"grpo: {result['error']}; see {log_path}")
        return result
    compared = compare(run_dir)
    peak = load_cluster(costed_as).peak_flops_per_second(job.models["actor"].dtype)
    iteration = compared["iteration"]
    result |= {"measured_step_seconds": iteration["measured_seconds"],
               "predicted_step_seconds": iteration["predicted_seconds"],
               "step_error_percent": iteration["error_percent"],
               "median_abs_mfc_error_percent": compared["median_abs_mfc_error_percent"],
               "mfcs": [{"name": m["name"], "measured_seconds": m["measured_seconds"],
                         "step_seconds": m["step_seconds"], "predicted_seconds": m["predicted_seconds"],
                         "error_percent": m["error_percent"], "achieved_tflops": m["achieved_tflops"],
                         "mfu": m["achieved_tflops"] * 1e12 / peak if m["achieved_tflops"] is not None else None,
                         "peak_memory_bytes": m["peak_memory_bytes"],
                         "predicted_peak_memory_bytes": m["predicted_peak_memory_bytes"]} for m in compared["mfcs"]],
               "warnings": compared["warnings"]}
    clock.say(f"grpo: step {iteration['measured_seconds']:.3f} s measured, {iteration['predicted_seconds']:.3f} s "
              f"predicted ({iteration['error_percent']:+.1f}%)")
    return result


def summary(result: dict) -> dict:
    """The figures the targets are about, and whether each is met (None: not measured)."""
    high = [c for c in result.get("decode", {}).get("cases", []) if c["concurrency"] >= TARGETS["decode_min_concurrency"]]
    by_cache = {cache: min((c["roofline_fraction"] for c in high if c["cache"] == cache
                            and c["roofline_fraction"] is not None), default=None)
                for cache in ("paged", "contiguous")}
    train_mfu = result.get("train", {}).get("mfu")
    step_error = result.get("grpo", {}).get("step_error_percent")
    return {"decode_min_roofline_fraction_at_128_plus": by_cache,
            "decode_target_met": {cache: None if v is None else v >= TARGETS["decode_roofline_fraction"]
                                  for cache, v in by_cache.items()},
            "train_mfu": train_mfu,
            "train_target_met": None if train_mfu is None else train_mfu >= TARGETS["train_mfu"],
            "grpo_step_error_percent": step_error,
            "grpo_target_met": None if step_error is None else abs(step_error) <= TARGETS["grpo_step_abs_error_percent"]}


def default_cluster(device: torch.device) -> str:
    """As scripts/gpu_check.sh's ``costs`` part: the cluster file of the GPU at hand, by its name."""
    if device.type != "cuda":
        return "local-cpu"
    name = torch.cuda.get_device_name(device)
    for marker, cluster in (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100", "a100-80gb")):
        if marker in name:
            return cluster
    raise SystemExit(f"no cluster file for {name!r}; pass --cluster NAME")


def flash_attn_version() -> str | None:
    try:
        import flash_attn  # optional, GPU machines only
    except ImportError:
        return None
    return flash_attn.__version__


def run(args: argparse.Namespace) -> dict:
    clock = Clock()
    device = torch.device(args.device)
    w = WORKLOADS[args.size]
    cluster = load_cluster(args.cluster or default_cluster(device))
    out = Path(args.out) if args.out else None
    result = {
        "issue": "29 item 4", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": device.type, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cluster": cluster.name, "cluster_device": cluster.device, "dtype": args.dtype, "size": args.size,
        "torch": torch.__version__, "flash_attn": flash_attn_version(),
        "note": (None if device.type == "cuda" else
                 "CPU dry run: checks the paths and the JSON's shape; its figures say nothing about a GPU"),
        "model": {**{k: getattr(w.arch, k) for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads",
                                                      "num_kv_heads", "head_dim", "vocab_size")},
                  "parameters": None, "weight_bytes": weight_bytes(w.arch, args.dtype),
                  "kv_bytes_per_token": kv_bytes_per_token(w.arch, args.dtype)},
        "peak_flops_per_second": cluster.peak_flops_per_second(args.dtype),
        "memory_bandwidth_bytes_per_second": cluster.memory_bandwidth_bytes_per_second,
        "targets": TARGETS, "budget_seconds": BUDGET_SECONDS}

    def save(part: str) -> None:
        result.pop("summary", None)
        result["summary"] = summary(result)  # last, after the parts so far
        result.pop("wall_seconds", None)
        result["wall_seconds"] = clock.now()
        if out is not None:
            out.write_text(json.dumps(result, indent=1) + "\n")
        clock.say(f"{part} done")

    module = random_model(w.arch, DTYPES[args.dtype], device)
    result["model"]["parameters"] = sum(p.numel() for p in module.parameters())
    clock.say(f"{result['model']['parameters'] / 1e6:.1f}M-parameter model on {result['device_name']}, "
              f"{args.dtype}, costed as {cluster.name}")
    with torch.no_grad():
        result["decode"] = decode_part(module, w, args.dtype, cluster, clock)
        save("decode")
        result["prefill"] = prefill_part(module, w, args.dtype, cluster, clock)
        save("prefill")
    result["train"] = train_part(module, w, args.dtype, cluster, clock)
    save("train")
    del module
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the job's process needs the memory
    log_path = (out.parent if out is not None else Path("/tmp")) / "gpu_limits_grpo.log"
    result["grpo"] = grpo_part(w, cluster, clock, log_path)
    save("grpo")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--size", choices=sorted(WORKLOADS), default="1b")
    parser.add_argument("--cluster", help="cluster file of peak FLOP/s and HBM bandwidth (default: by the device's name)")
    parser.add_argument("--out", help="write the JSON here after each part")
    parser.add_argument("--json", action="store_true", help="print the JSON on stdout at the end")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    with contextlib.redirect_stdout(sys.stderr):  # libraries' notices stay off stdout, which carries the result
        result = run(args)
    if args.json:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
