"""Generation throughput: restage's rollout engine against transformers' ``generate``, same model, same device.

A random LLaMA-family model (``--size 40m``: ``restage.models.tiny.BENCH_SIZES``; ``100m``: wider and
deeper, below) is built locally and two workloads run, each ``--repeats`` times after one warm-up,
restage and transformers alternating (restage, transformers, restage, ...) so both see the same
machine load:

* ``fixed``: a batch of prompts of uneven lengths continued greedily for exactly ``--new-tokens``
  tokens (EOS off). transformers gets the batch left-padded with an attention mask.
* ``rollout``: what an RL step asks for. ``--prompts`` prompts, ``--group`` sampled answers each
  (GRPO), temperature 1 and no top-k/top-p filter by default (RL samples the policy itself, so
  that the rollout's logprobs are the trainer's), more requests than restage's ``--slots`` cache slots.
  A random model has no real EOS, so a stop set of a share of the vocabulary stands in for it:
  answers end after a geometric number of tokens, from one to ``--new-tokens``. One rollout case
  runs per share in ``--stop-fractions`` (default 1%, 5% and 10%: about 1/share tokens on average
  before the cap, so at 1% about half the answers reach 64 tokens, at 10% few do).
  transformers runs ``generate(do_sample=True, num_return_sequences=group)`` with the same
  settings and stop ids, all requests in one padded batch.

Throughput is generated tokens (up to and including the stop token) per second.
``speedup_vs_transformers`` is the median over the repeats of restage's rate over transformers' in the
same repeat: a slow phase of a shared machine that spans both runs of a repeat cancels in their ratio,
and the median drops the repeat where it hit one side only (a best-of ratio keeps whichever side was
luckiest). ``speedup_vs_transformers_best`` (fastest run over fastest run) and every repeat's ratio
(``speedup_vs_transformers_repeats``) are kept beside it; the rates and seconds shown are medians.

On CUDA transformers also runs with its static KV cache and its decode forward compiled, beside its
eager generate: ``generate(..., cache_implementation="static", compile_config=CompileConfig(mode=
"reduce-overhead"))``. transformers 5.x compiles the decoding forward itself when the cache is static
and the device is CUDA (``GenerationMixin._valid_auto_compile_criteria``; the prefill stays eager), so
the model's forward is not wrapped by hand; ``reduce-overhead`` replays CUDA graphs. It gets one more
warm-up call than the others (compilation), and its figures carry ``transformers_static`` in their names
(``speedup_vs_transformers_static``). On CPU that side is skipped and the result says why
(``transformers_static_skipped``).

On CUDA, ``--cuda-graphs off`` decodes eagerly instead of replaying one CUDA graph per batch bucket
(``generation.cuda_graphs``, ``restage.rollout.decode_graphs``): run it both ways for tokens/s with and
without graphs; the result then says ``cuda_graphs`` and the ``decode_mode`` the engine took. On CPU
the flag changes nothing (the engine decodes eagerly there).

Usage: ``python bench/generate.py [--json] [--size 40m|100m] [--case fixed|rollout|all] [--device cpu]
[--cuda-graphs on|off] [--stop-fractions 0.01 0.05 0.10] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import CompileConfig

from restage.device import DTYPES
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.models.tiny import BENCH_SIZES, FAMILIES, build_tiny, load_hf
from restage.rollout.budget import RolloutLimits
from restage.rollout.decode_graphs import choose_decode_mode
from restage.rollout.generation import generate
from restage.rollout.sampling import SamplingParams

SIZES = {"40m": BENCH_SIZES,
         "100m": dict(BENCH_SIZES, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048)}
MIN_REPEATS = 3  # the fewest that make a median differ from a mean or a best-of
STATIC = {"cache_implementation": "static", "compile_config": CompileConfig(mode="reduce-overhead")}
STATIC_TEXT = "generate(cache_implementation='static', compile_config=CompileConfig(mode='reduce-overhead'))"
STATIC_SKIPPED_ON_CPU = ("transformers' static cache compiled: skipped on CPU (generate compiles the decode forward "
                         "only on CUDA-like devices, and reduce-overhead's CUDA graphs need CUDA)")


def prompts_of(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (batch,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def timed(fn, device: torch.device) -> tuple[float, object]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, result


@dataclass(frozen=True)
class Timed:
    """One timed run: its wall seconds and its answers (each up to and including its stop token)."""

    seconds: float
    answers: list[list[int]]

    @property
    def tokens_per_second(self) -> float:
        return sum(map(len, self.answers)) / self.seconds


def alternating(runs: dict[str, Callable[[], list[list[int]]]], repeats: int,
                device: torch.device) -> dict[str, list[Timed]]:
    """Every run ``repeats`` times after one warm-up each, in turn (a, b, a, b, ...) so all see the same machine load."""
    for fn in runs.values():
        fn()  # warm-up: allocator, kernels, caches
    timings: dict[str, list[Timed]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            timings[name].append(Timed(*timed(fn, device)))
    return timings


def against(name: str, ours: list[Timed], theirs: list[Timed]) -> dict:
    """``name``'s median rate and seconds, and restage's speedup over it: the median of the per-repeat ratios (the
    headline), every ratio, and the fastest run over the fastest run."""
    ratios = [a.tokens_per_second / b.tokens_per_second for a, b in zip(ours, theirs, strict=True)]
    return {f"{name}_seconds": statistics.median(t.seconds for t in theirs),
            f"{name}_tokens_per_second": statistics.median(t.tokens_per_second for t in theirs),
            f"speedup_vs_{name}": statistics.median(ratios), f"speedup_vs_{name}_repeats": ratios,
            f"speedup_vs_{name}_best": max(a.tokens_per_second for a in ours) / max(b.tokens_per_second for b in theirs)}


def measured(runs: dict[str, Callable[[], list[list[int]]]], args, device) -> tuple[dict[str, list[Timed]], dict]:
    """restage against each other side in ``runs``; each side's timings and the figures of the comparisons."""
    if "transformers_static" in runs:
        runs["transformers_static"]()  # its extra warm-up: the first call compiles
    timings = alternating(runs, args.repeats, device)
    ours = timings["restage"]
    figures = {"repeats": args.repeats, "restage_seconds": statistics.median(t.seconds for t in ours),
               "restage_tokens_per_second": statistics.median(t.tokens_per_second for t in ours)}
    for name in runs.keys() - {"restage"}:
        figures |= against(name, ours, timings[name])
    return timings, figures


def left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):
        input_ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    return input_ids.to(device), mask.to(device)


def until_stop(row: list[int], stop: set[int]) -> list[int]:
    return next((row[: i + 1] for i, t in enumerate(row) if t in stop), row)


def transformers_sides(hf_run: Callable[..., list[list[int]]], device: torch.device) -> dict:
    """transformers' eager generate and, on CUDA, its static cache with the compiled decode forward."""
    sides = {"transformers": hf_run}
    if device.type == "cuda":
        sides["transformers_static"] = lambda: hf_run(**STATIC)
    return sides


def fixed_case(ours, hf, args, device) -> dict:
    prompts = prompts_of(args.batch, ours.cfg.vocab_size)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, greedy=True, eos_token_ids=(),
                              cuda_graphs=args.cuda_graphs == "on")
    input_ids, mask = left_padded(prompts, device)

    @torch.no_grad()
    def hf_run(**cache) -> list[list[int]]:
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None, **cache)
        return out[:, input_ids.shape[1]:].tolist()

    runs = {"restage": lambda: generate(ours, prompts, sampling).sequences(), **transformers_sides(hf_run, device)}
    timings, figures = measured(runs, args, device)
    # Greedy, so every run of a side gives the same tokens: the first of each is compared.
    same = {name: sum(a == b for a, b in zip(timings["restage"][0].answers, t[0].answers))
            for name, t in timings.items() if name != "restage"}
    return {"case": "fixed", "batch": args.batch, "new_tokens": args.new_tokens, "greedy": True,
            "prompt_tokens": [len(p) for p in prompts], **figures,
            "identical_sequences": f"{same['transformers']}/{args.batch}",
            **({"identical_sequences_static": f"{same['transformers_static']}/{args.batch}"}
               if "transformers_static" in same else {})}


def _lengths(timings: list[Timed]) -> dict:
    """Answer lengths over every timed run of one side, and each run's total."""
    lengths = [len(a) for t in timings for a in t.answers]
    return {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths),
            "total_per_run": [sum(map(len, t.answers)) for t in timings]}


def rollout_case(ours, hf, args, device, stop_fraction: float) -> dict:
    vocab = ours.cfg.vocab_size
    prompts = prompts_of(args.prompts, vocab, seed=1)
    stop_ids = tuple(range(3, 3 + max(1, int(stop_fraction * vocab))))
    stop = set(stop_ids)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=args.top_p, eos_token_ids=stop_ids,
                              cuda_graphs=args.cuda_graphs == "on")
    limits = RolloutLimits(max_slots=args.slots)
    input_ids, mask = left_padded(prompts, device)

    def ours_run() -> list[list[int]]:
        return generate(ours, prompts, sampling, group_size=args.group, limits=limits).sequences()

    @torch.no_grad()
    def hf_run(**cache) -> list[list[int]]:
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=True,
                          temperature=1.0, top_p=args.top_p, top_k=0, num_return_sequences=args.group, pad_token_id=0,
                          eos_token_id=list(stop_ids), **cache)
        return [until_stop(row, stop) for row in out[:, input_ids.shape[1]:].tolist()]

    timings, figures = measured({"restage": ours_run, **transformers_sides(hf_run, device)}, args, device)
    return {"case": "rollout", "stop_fraction": stop_fraction, "prompts": args.prompts, "group": args.group,
            "requests": args.prompts * args.group, "slots": args.slots, "new_tokens": args.new_tokens,
            "temperature": 1.0, "top_p": args.top_p, "stop_ids": len(stop_ids),
            "prompt_tokens": [len(p) for p in prompts],
            **{f"{name}_answer_tokens": _lengths(t) for name, t in timings.items()}, **figures}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny(Path(tmp) / args.family, args.family, tied=False, tokenizer=False, **SIZES[args.size])
        ours = load_stage(path, Layout((0,), Strategy()), None, 0, dtype=dtype, device=device)
        hf = load_hf(path, dtype=dtype).to(device)
    result = {"family": args.family, "size": args.size, "parameters": sum(p.numel() for p in ours.parameters()),
              "dtype": args.dtype, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{args.threads} threads"}
    if device.type == "cuda":  # the fields a CPU run has stay as they were
        result["cuda_graphs"] = args.cuda_graphs
        result["decode_mode"] = choose_decode_mode(device, enabled=args.cuda_graphs == "on", tp_size=1, pp_size=1,
                                                   ep_size=1, sparse=bool(ours.cfg.sparse_layers))[0]
        result["transformers_static"] = STATIC_TEXT
    else:
        result["transformers_static_skipped"] = STATIC_SKIPPED_ON_CPU
    cases = [fixed_case(ours, hf, args, device)] if args.case in ("fixed", "all") else []
    if args.case in ("rollout", "all"):
        cases += [rollout_case(ours, hf, args, device, fraction) for fraction in args.stop_fractions]
    return {**result, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), default="40m")
    parser.add_argument("--case", choices=["fixed", "rollout", "all"], default="all")
    parser.add_argument("--batch", type=int, default=8, help="fixed: prompts")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8, help="rollout: prompts")
    parser.add_argument("--group", type=int, default=8, help="rollout: samples per prompt")
    parser.add_argument("--slots", type=int, default=32, help="rollout: restage's KV cache slots")
    parser.add_argument("--top-p", type=float, default=1.0, help="rollout: 1 (off), as RL rollouts sample the policy")
    parser.add_argument("--stop-fractions", type=float, nargs="+", default=[0.01, 0.05, 0.10],
                        help="rollout: vocabulary shares that end answers, one case each (default 0.01 0.05 0.10)")
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS,
                        help=f"timed runs of each side, alternating; the median ratio the headline (at least {MIN_REPEATS})")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                        help="CUDA: replay decode steps as CUDA graphs (on) or decode eagerly (off)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.repeats < MIN_REPEATS:
        parser.error(f"--repeats {args.repeats}: the headline is a median, so at least {MIN_REPEATS}")
    # Libraries imported on the way may log to stdout (DeepSpeed's accelerator notice, through transformers):
    # stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(format_text(result))
    return 0


def format_text(result: dict) -> str:
    lines = [f"{result['family']} model, {result['parameters'] / 1e6:.1f}M parameters, {result['dtype']} on "
             f"{result['device_name']}" + (f", decode {result['decode_mode']}" if "decode_mode" in result else "")]
    if "transformers_static_skipped" in result:
        lines.append(result["transformers_static_skipped"])
    for case in result["cases"]:
        label = case["case"] + (f", {case['stop_fraction']:.0%} stop set" if "stop_fraction" in case else "")
        lines.append(f"{label}: restage {case['restage_tokens_per_second']:.1f} tokens/s "
                     f"({case['restage_seconds']:.2f} s); medians of {case['repeats']} alternating runs")
        for name in ("transformers", "transformers_static"):
            if f"speedup_vs_{name}" in case:
                lines.append(f"  {name}: {case[f'{name}_tokens_per_second']:.1f} tokens/s ({case[f'{name}_seconds']:.2f} s), "
                             f"restage's median speedup {case[f'speedup_vs_{name}']:.2f}x (repeats "
                             + ", ".join(f"{r:.2f}" for r in case[f"speedup_vs_{name}_repeats"])
                             + f"; best / best {case[f'speedup_vs_{name}_best']:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
