"""Generation throughput: restage's rollout engine against transformers' ``generate``, same model, same device.

A random LLaMA-family model (``--size 40m``: ``restage.models.tiny.BENCH_SIZES``; ``100m``: wider and
deeper, below) is built locally and two workloads run, each the best of ``--repeats`` timed runs
after one warm-up, restage and transformers alternating so both see the same machine load:

* ``fixed``: a batch of prompts of uneven lengths continued greedily for exactly ``--new-tokens``
  tokens (EOS off). transformers gets the batch left-padded with an attention mask.
* ``rollout``: what an RL step asks for. ``--prompts`` prompts, ``--group`` sampled answers each
  (GRPO), temperature 1 and no top-k/top-p filter by default (RL samples the policy itself, so
  that the rollout's logprobs are the trainer's), more requests than restage's ``--slots`` cache slots.
  A random model has no real EOS, so a stop set of ``--stop-fraction`` of the vocabulary stands in
  for it: answers end after a geometric number of tokens, from one to ``--new-tokens``.
  transformers runs ``generate(do_sample=True, num_return_sequences=group)`` with the same
  settings and stop ids, all requests in one padded batch.

Throughput is generated tokens (up to and including the stop token) per second;
``speedup_vs_transformers`` is restage's over transformers'.

On CUDA, ``--cuda-graphs off`` decodes eagerly instead of replaying one CUDA graph per batch bucket
(``generation.cuda_graphs``, ``restage.models.decode_graphs``): run it both ways for tokens/s with and
without graphs; the result then says ``cuda_graphs`` and the ``decode_mode`` the engine took. On CPU
the flag changes nothing (the engine decodes eagerly there).

Usage: ``python bench/generate.py [--json] [--size 40m|100m] [--case fixed|rollout|all] [--device cpu]
[--cuda-graphs on|off]``.
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
from pathlib import Path

import torch

from restage.device import DTYPES
from restage.layout import Layout, Strategy
from restage.models.checkpoint import load_stage
from restage.models.decode_graphs import choose_decode_mode
from restage.models.generation import generate
from restage.models.rollout import RolloutLimits
from restage.models.sampling import SamplingParams
from restage.models.tiny import BENCH_SIZES, FAMILIES, build_tiny, load_hf

SIZES = {"40m": BENCH_SIZES,
         "100m": dict(BENCH_SIZES, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048)}


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


def best_of(runs: dict, repeats: int, device: torch.device) -> dict[str, tuple[float, object]]:
    """Best time of each run; the runs alternate so that both see the same machine load."""
    for fn in runs.values():
        fn()  # warm-up: allocator, kernels, caches
    best = {name: (float("inf"), None) for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seconds, result = timed(fn, device)
            if seconds < best[name][0]:
                best[name] = (seconds, result)
    return best


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


def fixed_case(ours, hf, args, device) -> dict:
    prompts = prompts_of(args.batch, ours.cfg.vocab_size)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, greedy=True, eos_token_ids=(),
                              cuda_graphs=args.cuda_graphs == "on")
    input_ids, mask = left_padded(prompts, device)

    @torch.no_grad()
    def hf_run():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, input_ids.shape[1]:].tolist()

    best = best_of({"restage": lambda: generate(ours, prompts, sampling).sequences(), "transformers": hf_run},
                   args.repeats, device)
    (ours_seconds, ours_tokens), (hf_seconds, hf_tokens) = best["restage"], best["transformers"]
    generated = args.batch * args.new_tokens
    same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
    return {"case": "fixed", "batch": args.batch, "new_tokens": args.new_tokens, "greedy": True,
            "prompt_tokens": [len(p) for p in prompts], "restage_seconds": ours_seconds,
            "transformers_seconds": hf_seconds, "restage_tokens_per_second": generated / ours_seconds,
            "transformers_tokens_per_second": generated / hf_seconds, "speedup_vs_transformers": hf_seconds / ours_seconds,
            "identical_sequences": f"{same}/{args.batch}"}


def rollout_case(ours, hf, args, device) -> dict:
    vocab = ours.cfg.vocab_size
    prompts = prompts_of(args.prompts, vocab, seed=1)
    stop_ids = tuple(range(3, 3 + max(1, int(args.stop_fraction * vocab))))
    stop = set(stop_ids)
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, top_p=args.top_p, eos_token_ids=stop_ids,
                              cuda_graphs=args.cuda_graphs == "on")
    limits = RolloutLimits(max_slots=args.slots)
    input_ids, mask = left_padded(prompts, device)

    def ours_run():
        return generate(ours, prompts, sampling, group_size=args.group, limits=limits).sequences()

    @torch.no_grad()
    def hf_run():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=True,
                          temperature=1.0, top_p=args.top_p, top_k=0, num_return_sequences=args.group, pad_token_id=0,
                          eos_token_id=list(stop_ids))
        return [until_stop(row, stop) for row in out[:, input_ids.shape[1]:].tolist()]

    best = best_of({"restage": ours_run, "transformers": hf_run}, args.repeats, device)
    (ours_seconds, ours_answers), (hf_seconds, hf_answers) = best["restage"], best["transformers"]
    ours_lengths, hf_lengths = [len(a) for a in ours_answers], [len(a) for a in hf_answers]
    ours_rate, hf_rate = sum(ours_lengths) / ours_seconds, sum(hf_lengths) / hf_seconds
    return {"case": "rollout", "prompts": args.prompts, "group": args.group, "requests": args.prompts * args.group,
            "slots": args.slots, "new_tokens": args.new_tokens, "temperature": 1.0, "top_p": args.top_p,
            "stop_ids": len(stop_ids), "prompt_tokens": [len(p) for p in prompts],
            "restage_answer_tokens": {"min": min(ours_lengths), "median": statistics.median(ours_lengths),
                                      "max": max(ours_lengths), "total": sum(ours_lengths)},
            "transformers_answer_tokens": {"min": min(hf_lengths), "median": statistics.median(hf_lengths),
                                           "max": max(hf_lengths), "total": sum(hf_lengths)},
            "restage_seconds": ours_seconds, "transformers_seconds": hf_seconds,
            "restage_tokens_per_second": ours_rate, "transformers_tokens_per_second": hf_rate,
            "speedup_vs_transformers": ours_rate / hf_rate}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny(Path(tmp) / args.family, args.family, tied=False, tokenizer=False, **SIZES[args.size])
        ours = load_stage(path, Layout((0,), Strategy()), None, 0, dtype=dtype, device=device)
        hf = load_hf(path, dtype=dtype).to(device)
    cases = {"fixed": fixed_case, "rollout": rollout_case}
    chosen = list(cases) if args.case == "all" else [args.case]
    result = {"family": args.family, "size": args.size, "parameters": sum(p.numel() for p in ours.parameters()),
              "dtype": args.dtype, "device": str(device),
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{args.threads} threads"}
    if device.type == "cuda":  # the fields a CPU run has stay as they were
        result["cuda_graphs"] = args.cuda_graphs
        result["decode_mode"] = choose_decode_mode(device, enabled=args.cuda_graphs == "on", tp_size=1, pp_size=1,
                                                   ep_size=1, sparse=bool(ours.cfg.sparse_layers))[0]
    return {**result, "cases": [cases[name](ours, hf, args, device) for name in chosen]}


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
    parser.add_argument("--stop-fraction", type=float, default=0.05, help="rollout: vocabulary share that ends answers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cuda-graphs", choices=["on", "off"], default="on",
                        help="CUDA: replay decode steps as CUDA graphs (on) or decode eagerly (off)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Libraries imported on the way may log to stdout (DeepSpeed's accelerator notice, through transformers):
    # stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['family']} model, {result['parameters'] / 1e6:.1f}M parameters, {result['dtype']} on "
          f"{result['device_name']}" + (f", decode {result['decode_mode']}" if "decode_mode" in result else ""))
    for case in result["cases"]:
        print(f"{case['case']}: restage {case['restage_tokens_per_second']:.1f} tokens/s ({case['restage_seconds']:.2f} s), "
              f"transformers {case['transformers_tokens_per_second']:.1f} tokens/s ({case['transformers_seconds']:.2f} s), "
              f"{case['speedup_vs_transformers']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
