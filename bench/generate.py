"""Generation throughput: restage's KV-cache generate against transformers' ``generate``, same model, same device.

A random ~40M-parameter model (``restage.models.tiny.BENCH_SIZES``) is built locally, a batch of
prompts of uneven lengths is continued greedily for a fixed number of new tokens (EOS off, so
both produce exactly ``batch x new_tokens`` tokens), and the best of ``--repeats`` timed runs
after one warm-up is reported as generated tokens per second; the two implementations alternate
so both see the same machine load. transformers gets the batch left-padded with an attention
mask, the way it expects a batch of uneven prompts; restage packs it without padding.

Usage: ``python bench/generate.py [--json] [--family llama] [--batch 8] [--new-tokens 64] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from restage.device import DTYPES
from restage.layout import Layout, Strategy
from restage.models.checkpoint import load_stage
from restage.models.generation import SamplingParams, generate
from restage.models.tiny import BENCH_SIZES, FAMILIES, build_tiny, load_hf


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


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny(Path(tmp) / args.family, args.family, tied=False, tokenizer=False, **BENCH_SIZES)
        ours = load_stage(path, Layout((0,), Strategy()), None, 0, dtype=dtype, device=device)
        hf = load_hf(path, dtype=dtype).to(device)
    params_count = sum(p.numel() for p in ours.parameters())
    prompts = prompts_of(args.batch, BENCH_SIZES["vocab_size"])
    sampling = SamplingParams(max_new_tokens=args.new_tokens, greedy=True, eos_token_ids=())

    def restage_run():
        return generate(ours, prompts, sampling).sequences()

    longest = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), longest, dtype=torch.int64)
    mask = torch.zeros_like(input_ids)
    for row, p in enumerate(prompts):  # left padding
        input_ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)

    @torch.no_grad()
    def hf_run():
        out = hf.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, longest:].tolist()

    best = best_of({"restage": restage_run, "transformers": hf_run}, args.repeats, device)
    (ours_seconds, ours_tokens), (hf_seconds, hf_tokens) = best["restage"], best["transformers"]
    generated = args.batch * args.new_tokens
    same = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
    return {
        "family": args.family, "parameters": params_count, "batch": args.batch, "new_tokens": args.new_tokens,
        "prompt_tokens": [len(p) for p in prompts], "dtype": args.dtype, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{args.threads} threads",
        "restage_seconds": ours_seconds, "transformers_seconds": hf_seconds,
        "restage_tokens_per_second": generated / ours_seconds, "transformers_tokens_per_second": generated / hf_seconds,
        "speedup": hf_seconds / ours_seconds, "identical_sequences": f"{same}/{args.batch}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['family']} model, {result['parameters'] / 1e6:.1f}M parameters, {result['dtype']} on {result['device_name']}")
    print(f"batch {result['batch']} prompts of {min(result['prompt_tokens'])}-{max(result['prompt_tokens'])} tokens, "
          f"{result['new_tokens']} new tokens each (greedy)")
    print(f"  restage      {result['restage_tokens_per_second']:8.1f} tokens/s  ({result['restage_seconds']:.2f} s)")
    print(f"  transformers {result['transformers_tokens_per_second']:8.1f} tokens/s  ({result['transformers_seconds']:.2f} s)")
    print(f"  ratio restage / transformers: {result['speedup']:.2f}x; identical sequences: {result['identical_sequences']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
