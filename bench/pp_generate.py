"""Pipeline-parallel generation under pp=2 on CPU gloo: stages one after another against micro-groups in flight.

Two ranks (``runtime.control.spawn``, gloo, one thread each) hold the two stages of a random LLaMA-family
model (``--size``: ``bench/generate.py``'s sizes, or ``small``) and generate the same requests
with the two schedules of the rollout engine, alternating, best of ``--repeats`` after a warm-up:

* ``sequential`` (``RolloutLimits(pp_groups=1)``): a decode step runs all slots through stage 0,
  then stage 1; the last stage's tokens are broadcast to both stages.
* ``pipelined`` (``pp_groups`` unset: 2 micro-groups, ``restage.rollout.pipelined``): stage 0
  works on one group while stage 1 works on the other.

Both decode the same slots (``--slots``), the same requests (``--requests`` greedy answers of
exactly ``--new-tokens`` tokens, EOS off, so both do the same work) and give the same tokens
(checked). Per rank: wall seconds of the run, seconds inside the stage's forward (the time it
is busy), their ratio ``busy_share``, the forward calls it made, and the schedule's ticks (one
stage-forward time each) with the share in which this stage had work, ``busy_tick_share``: the
figure a GPU follows. Sequential, a step is ``pp`` ticks and each stage works in one of them;
pipelined, each stage works at every tick but the fill, the drain and a finished group's.
On a CPU whose per-forward cost hardly grows with the batch (small models, Python overhead), a
group's half-size forward costs about as much as the full one and the wall time need not drop;
the ``forward_seconds_per_call`` of both schedules shows which regime it is. Two ranks on two
cores shared with other jobs also rarely run at once, which the overlap needs.

Usage: ``python bench/pp_generate.py [--json] [--size small|40m|100m] [--slots 16] [--requests 32]
[--new-tokens 32] [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

SMALL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704, vocab_size=4096,
             max_positions=512)
SCHEDULES = {"sequential": 1, "pipelined": None}


def _bench(rank: int, world_size: int, path: str, args: dict) -> dict:
    from restage.layout import Layout, ProcessGroups, Strategy
    from restage.models.hf_checkpoint import load_stage
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.engine import RolloutEngine
    from restage.rollout.pipelined import PipelinedRollout
    from restage.rollout.sampling import SamplingParams, request_keys

    torch.set_num_threads(1)
    layout = Layout(tuple(range(world_size)), Strategy(pp=world_size))
    module = load_stage(path, layout, ProcessGroups(layout.all_groups()), rank)
    forward = module.forward
    busy = {"seconds": 0.0, "calls": 0}

    def timed(*a, **k):
        start = time.perf_counter()
        try:
            return forward(*a, **k)
        finally:
            busy["seconds"] += time.perf_counter() - start
            busy["calls"] += 1

    module.forward = timed  # type: ignore[method-assign]  # this rank's module only: time spent computing
    generator = torch.Generator().manual_seed(0)
    vocab = module.cfg.vocab_size
    prompts = [torch.randint(3, vocab, (int(n),), generator=generator).tolist()
               for n in torch.randint(16, 49, (args["requests"],), generator=generator)]
    params = SamplingParams(max_new_tokens=args["new_tokens"], greedy=True, eos_token_ids=())

    def once(pp_groups):
        limits = RolloutLimits(max_slots=args["slots"], pp_groups=pp_groups)
        engine = RolloutEngine(module, prompts, list(range(len(prompts))), [args["new_tokens"]] * len(prompts),
                               request_keys(range(len(prompts))), params, [], limits)
        busy["seconds"], busy["calls"] = 0.0, 0
        torch.distributed.barrier()
        start = time.perf_counter()
        if engine.num_groups > 1:
            runner = PipelinedRollout(engine)
            tokens = runner.run()[0]
            ticks, busy_ticks = runner.log.ticks, runner.log.busy_ticks
        else:  # stage after stage: a tick per stage per step, this stage's forward in one of every pp of them
            tokens = engine.run()[0]
            ticks, busy_ticks = world_size * busy["calls"], busy["calls"]
        wall = time.perf_counter() - start
        return {"wall_seconds": wall, "busy_seconds": busy["seconds"], "forward_calls": busy["calls"],
                "ticks": ticks, "busy_ticks": busy_ticks, "tokens": tokens}

    for pp_groups in SCHEDULES.values():  # warm-up
        once(pp_groups)
    best: dict[str, dict] = {}
    for _ in range(args["repeats"]):
        for name, pp_groups in SCHEDULES.items():
            run = once(pp_groups)
            if name not in best or run["wall_seconds"] < best[name]["wall_seconds"]:
                best[name] = run
    same = torch.equal(best["sequential"].pop("tokens"), best["pipelined"].pop("tokens"))
    return {"rank": rank, "same_tokens": same, **best}


def run(args: argparse.Namespace) -> dict:
    # DeepSpeed, imported by the ranks on the way, prints its accelerator guess to stdout unless told (a CPU bench).
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from restage.models.tiny import BENCH_SIZES, build_tiny
    from restage.runtime.control.spawn import spawn

    sizes = {"small": SMALL, "40m": BENCH_SIZES,
             "100m": dict(BENCH_SIZES, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=2048)}
    settings = {"slots": args.slots, "requests": args.requests, "new_tokens": args.new_tokens, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(build_tiny(Path(tmp) / "llama", "llama", tied=False, tokenizer=False, **sizes[args.size]))
        load_before = os.getloadavg()[0]
        ranks = spawn(_bench, 2, path, settings, timeout_seconds=3000)
    tokens = args.requests * args.new_tokens
    result: dict = {"size": args.size, "pp": 2, "device": "cpu gloo, 2 ranks x 1 thread", **settings,
                    "load_average_1min": [load_before, os.getloadavg()[0]], "cpus": os.cpu_count(),
                    "same_tokens": all(r["same_tokens"] for r in ranks), "schedules": {}}
    for name in SCHEDULES:
        wall = max(r[name]["wall_seconds"] for r in ranks)
        result["schedules"][name] = {
            "wall_seconds": wall, "tokens_per_second": tokens / wall,
            "decode_step_seconds": wall / args.new_tokens,  # one token for every request: a step (or round) per slot fill
            "stages": [{"stage": r["rank"], "busy_share": r[name]["busy_seconds"] / r[name]["wall_seconds"],
                        "forward_calls": r[name]["forward_calls"], "ticks": r[name]["ticks"],
                        "busy_tick_share": r[name]["busy_ticks"] / max(1, r[name]["ticks"]),
                        "ticks_per_token": r[name]["ticks"] / tokens,
                        "forward_seconds_per_call": r[name]["busy_seconds"] / max(1, r[name]["forward_calls"])}
                       for r in ranks]}
    seq, pipe = result["schedules"]["sequential"], result["schedules"]["pipelined"]
    result["speedup_pipelined_vs_sequential"] = seq["wall_seconds"] / pipe["wall_seconds"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["small", "40m", "100m"], default="40m")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    # Libraries imported on the way may log to stdout (DeepSpeed's accelerator notice, through transformers):
    # stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"pp=2 on CPU gloo, {args.size}, {args.requests} requests x {args.new_tokens} tokens, {args.slots} slots "
          f"(same tokens: {result['same_tokens']})")
    for name, row in result["schedules"].items():
        shares = ", ".join(f"stage {s['stage']} busy {s['busy_share']:.0%} of the time, {s['busy_tick_share']:.0%} of "
                           f"{s['ticks']} ticks ({s['forward_calls']} forwards, {1e3 * s['forward_seconds_per_call']:.1f}"
                           f" ms each)" for s in row["stages"])
        print(f"  {name:10s} {row['wall_seconds']:.2f} s, {row['tokens_per_second']:.0f} tok/s; {shares}")
    print(f"  pipelined / sequential speedup: {result['speedup_pipelined_vs_sequential']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
