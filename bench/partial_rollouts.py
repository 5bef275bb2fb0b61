"""Partial rollouts against whole batches: the rollout engine's work per batch on the GRPO 256x4 job's generation.

    python bench/partial_rollouts.py [--json] [--batches 12] [--repeats 3] [--job jobs/grpo_256x4.yaml]

Both sides generate the same batches (the job's prompts in order, ``batch_size`` prompts x ``group_size`` answers,
its sampling, the seeds async mode gives each batch) with unchanged weights, so both produce the same answers
token for token (checked): only the schedule differs.

* ``whole``: each batch generated alone (``generation.generate``), as async mode without partial rollouts does.
* ``partial``: batch ``t`` finished while batch ``t + 1`` begins in the slots ``t`` frees
  (``generation.continue_generate``, as ``runtime/step/partial_rollouts.py`` calls it each step); the cut answers are
  prefilled again at the next call, as they are after every weight push.

Counted exactly (the engine's decode steps and prefilled tokens, per batch) and timed (the best of ``--repeats``
runs of all batches, the two sides alternating so both see the same machine load). On a CPU a decode step of a
small model costs about the same for 1 or 16 slots, so decode steps per batch is what partial rollouts change:
without them the engine decodes until a batch's longest answer ends, with its other slots idle.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--job", default="jobs/grpo_256x4.yaml")
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    os.chdir(ROOT)
    import torch

    from restage.config.load import load_config
    from restage.data.datasets import load_splits
    from restage.demo import ensure_llama_256x4, ensure_tiny_model
    from restage.layout import Layout, Strategy
    from restage.models.hf_checkpoint import load_stage
    from restage.rollout.engine import RolloutEngine
    from restage.rollout.generation import PartialRequest, continue_generate, generate
    from restage.rollout.sampling import SamplingParams, request_seed

    torch.set_num_threads(1)
    ensure_tiny_model()
    ensure_llama_256x4()
    cfg = load_config(args.job)
    module = load_stage(cfg.models["actor"].path, Layout((0,), Strategy()), None, 0)
    train, _ = load_splits(cfg)
    group, size = int(cfg.algo["group_size"]), cfg.run.batch_size
    batches = []
    for b in range(args.batches):
        prompts = train.batch(list(range(b * size, (b + 1) * size)))
        batches.append([t.tolist() for t in torch.split(prompts["prompts"], list(prompts.seqlens))])
    pad = module.cfg.pad_token_id or 0
    params = SamplingParams(max_new_tokens=cfg.generation.max_new_tokens, temperature=cfg.generation.temperature,
                            pad_token_id=pad)
    seeds = [[request_seed((cfg.seed * 1_000_003 + b) * 101, r) for r in range(size * group)] for b in range(args.batches)]

    counts = {"decode_steps": 0, "prefill_tokens": 0}
    decode, prefill = RolloutEngine._decode, RolloutEngine._prefill

    def counted_decode(self):
        counts["decode_steps"] += 1
        decode(self)

    def counted_prefill(self, slots, prefixes):
        counts["prefill_tokens"] += sum(len(p) for p in prefixes)
        prefill(self, slots, prefixes)

    RolloutEngine._decode, RolloutEngine._prefill = counted_decode, counted_prefill  # type: ignore[method-assign]

    def whole() -> list[list[int]]:
        answers = []
        for b, prompts in enumerate(batches):
            answers += generate(module, prompts, params, group_size=group, seeds=seeds[b]).sequences()
        return answers

    def partial() -> list[list[int]]:
        answers: list[list[int]] = []
        carried = [PartialRequest(tuple(batches[0][r // group]), s) for r, s in enumerate(seeds[0])]
        done: dict[int, list[int]] = {}  # row of the current batch -> its answer (finished while begun early)
        for b in range(args.batches):
            later = ([PartialRequest(tuple(batches[b + 1][r // group]), s) for r, s in enumerate(seeds[b + 1])]
                     if b + 1 < args.batches else [])
            rows = [r for r in range(len(carried)) if r not in done]
            out = continue_generate(module, [carried[r] for r in rows] + later, params, must_finish=len(rows))
            got, logprobs = out.output.sequences(), out.output.token_logprobs()
            answers += [done[r] if r in done else got[rows.index(r)] for r in range(len(carried))]
            done, carried = {}, []
            for i in range(len(later)):
                j = len(rows) + i
                if out.finished[j]:
                    done[i] = got[j]
                carried.append(PartialRequest(later[i].prompt, later[i].seed, tuple(got[j]), tuple(logprobs[j])))
        return answers

    result: dict = {"job": args.job, "batches": args.batches, "requests_per_batch": size * group,
                    "max_new_tokens": params.max_new_tokens, "cpus": os.cpu_count(),
                    "load_average_1min_before": os.getloadavg()[0]}
    outputs: dict[str, list[list[int]]] = {}
    seconds: dict[str, list[float]] = {"whole": [], "partial": []}
    for repeat in range(args.repeats + 1):  # the first run of each warms up, and is the one counted
        for name, fn in (("whole", whole), ("partial", partial)):
            counts.update(decode_steps=0, prefill_tokens=0)
            started = time.perf_counter()
            outputs[name] = fn()
            elapsed = time.perf_counter() - started
            if repeat == 0:
                result[name] = {k: v / args.batches for k, v in counts.items()}
            else:
                seconds[name].append(elapsed)
    assert outputs["whole"] == outputs["partial"], "the two schedules gave different answers"
    lengths = [len(a) for a in outputs["whole"]]
    result["answer_tokens_mean"] = statistics.mean(lengths)
    result["answer_tokens_max"] = max(lengths)
    for name in ("whole", "partial"):
        result[name]["seconds_per_batch"] = min(seconds[name]) / args.batches
        result[name]["tokens_per_second"] = sum(lengths) / min(seconds[name])
    result["decode_steps_ratio"] = result["partial"]["decode_steps"] / result["whole"]["decode_steps"]
    result["speedup"] = result["whole"]["seconds_per_batch"] / result["partial"]["seconds_per_batch"]
    result["load_average_1min_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"{args.job}: {args.batches} batches of {size * group} answers (mean {result['answer_tokens_mean']:.1f}, "
              f"max {result['answer_tokens_max']} tokens; cap {params.max_new_tokens}); load "
              f"{result['load_average_1min_before']:.1f} -> {result['load_average_1min_after']:.1f}")
        for name in ("whole", "partial"):
            r = result[name]
            print(f"  {name:7s} decode steps/batch {r['decode_steps']:.1f}, prefill tokens/batch "
                  f"{r['prefill_tokens']:.1f}, {r['seconds_per_batch'] * 1000:.1f} ms/batch, "
                  f"{r['tokens_per_second']:.0f} tokens/s")
        print(f"  partial/whole decode steps {result['decode_steps_ratio']:.2f}; speedup {result['speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
