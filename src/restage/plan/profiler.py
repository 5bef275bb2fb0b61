"""``restage profile``: time a decoder's pieces on this device and store the table.

The table goes to ``$RESTAGE_CLUSTER_DIR/profiles/`` when that is set, else to the user's cache
(``~/.cache/restage/profiles/``, ``plan.profile.user_profile_dir``), never into the repository unless
``--out`` says so; the planner searches both (``plan.profile.profile_dirs``). A line is printed per TP size
built and per timing round, with the time left.

For every TP size in the grid, one process builds the TP shard of a one-block model with the
real decoder (``restage.models.decoder.StageModule``) and times, over a grid of batch sizes and
sequence lengths: the embedding, one transformer block's forward and backward, the head's
forward and backward, a prefill (block forward that fills the KV cache), one decoding step of
one block against ``seq`` cached tokens, and an AdamW step (per parameter). The shard's
all-reduces run over a one-process group, so the table holds compute only; the estimator adds
communication from the cluster's links. Seconds are the median of ``--repeats`` rounds after a
warm-up, each round timing every piece of the grid once.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import assert_never

import torch
import torch.distributed as dist
import torch.nn.functional as F

from restage.device import DTYPES
from restage.errors import ConfigError
from restage.layout import Coord, Strategy
from restage.models.arch import ModelConfig
from restage.models.attention import Decode, Prefill
from restage.models.decoder import StageModule
from restage.models.packing import PackedBatch
from restage.models.parallel import ParallelContext, lm_logits
from restage.models.presets import preset
from restage.models.rope import RopeTables, rope_tables
from restage.models.sharding import validate_strategy
from restage.plan.profile import Profile, ProfileEntry, find_profile, user_profile_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--arch", default="llama-tiny", help="architecture preset (restage.models.presets)")
    what.add_argument("--model", help="HF model directory whose config.json to profile")
    parser.add_argument("--cluster", default=None, help="cluster the table is for (default local-cpu without a GPU)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default fp32 on CPU, bf16 on GPU")
    parser.add_argument("--batches", default="1,2,4,8", help="comma-separated batch sizes (sequences)")
    parser.add_argument("--seqs", default="32,64,128,256", help="comma-separated sequence / KV lengths")
    parser.add_argument("--tp", default="1,2", help="comma-separated TP sizes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="output file (default <cache>/<cluster>--<arch>--<dtype>.local.json, <cache> being "
                        "$RESTAGE_CLUSTER_DIR/profiles if set, else ~/.cache/restage/profiles)")


def main(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    cluster = args.cluster or ("local-cpu" if not cuda else None)
    if cluster is None:
        raise ConfigError("restage profile on a GPU needs --cluster NAME (the cluster file these GPUs belong to)")
    dtype = args.dtype or ("bf16" if cuda else "fp32")
    arch = ModelConfig.from_pretrained(args.model) if args.model else preset(args.arch)
    name = Path(args.model).name if args.model else args.arch
    grid = {k: [int(x) for x in getattr(args, k).split(",") if x] for k in ("batches", "seqs", "tp")}
    started = time.perf_counter()
    print(f"restage profile: {name} ({dtype}) on {cluster}: batches {grid['batches']}, seqs {grid['seqs']}, "
          f"tp {grid['tp']}, {args.repeats} rounds", flush=True)
    profile = measure(arch, cluster, dtype, grid["batches"], grid["seqs"], grid["tp"], args.repeats,
                      device="cuda" if cuda else "cpu", say=lambda line: print(f"restage profile: {line}", flush=True))

    cache = Path(os.environ["RESTAGE_CLUSTER_DIR"]) / "profiles" if os.environ.get("RESTAGE_CLUSTER_DIR") else None
    out = Path(args.out) if args.out else (cache or user_profile_dir()) / f"{cluster}--{name}--{dtype}.local.json"
    profile.save(out)
    print(f"{len(profile.entries)} timings of {name} ({dtype}, tp {grid['tp']}) on {profile.meta['device']} "
          f"in {time.perf_counter() - started:.1f} s -> {out}")
    used = find_profile(cluster, arch, dtype)
    if used is not None and used.name != out.name:
        print(f"restage profile: note: the planner takes {used.name}, found first (plan.profile.profile_dirs); "
              "pass --out with that file's path to replace it")
    return 0


# A timed piece: (op, tp, batch or tokens, seq or 1), as the profile's entries are keyed.
_Key = tuple[str, int, int, int]


@contextmanager
def _one_process_group() -> Iterator[dist.ProcessGroup | None]:
    """A gloo group of this process alone, so TP shards run their (trivial) collectives."""
    if dist.is_initialized():
        yield dist.group.WORLD
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def _timed_rounds(jobs: list[tuple[_Key, Callable[[], object]]], repeats: int, sync: Callable[[], None],
                  say: Callable[[str], None] = lambda line: None) -> dict[_Key, float]:
    """Median seconds of every job; one warm-up each, then ``repeats`` rounds that time every job once.

    Round-robin over the whole grid rather than ``repeats`` calls in a row: on a shared machine a
    burst of someone else's load then inflates one sample of many shapes instead of the median of
    one shape. Each round takes the jobs in another (seeded) order, so no job always runs right
    after the same (say, cache-flushing) neighbour.
    """
    began = time.perf_counter()
    for _, fn in jobs:
        fn()
    sync()
    round_seconds = time.perf_counter() - began
    say(f"warm-up of {len(jobs)} pieces done in {round_seconds:.1f} s; about {repeats * round_seconds:.0f} s left")
    samples: dict[_Key, list[float]] = {key: [] for key, _ in jobs}
    order = list(jobs)
    shuffle = random.Random(0).shuffle
    for done in range(1, repeats + 1):
        shuffle(order)
        round_began = time.perf_counter()
        for key, fn in order:
            start = time.perf_counter()
            fn()
            sync()
            samples[key].append(time.perf_counter() - start)
        round_seconds = time.perf_counter() - round_began
        say(f"round {done}/{repeats} done in {round_seconds:.1f} s; about {(repeats - done) * round_seconds:.0f} s left")
    return {key: statistics.median(values) for key, values in samples.items()}


def measure(arch: ModelConfig, cluster: str, dtype: str, batches: list[int], seqs: list[int], tps: list[int], repeats: int = 3,
            device: str = "cpu", say: Callable[[str], None] = lambda line: None) -> Profile:
    """Time the pieces of ``arch`` over the grid; returns the profile (not saved). ``say`` gets progress lines."""
    torch_dtype = DTYPES[dtype]
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    one_block = dataclasses.replace(arch, num_layers=1)
    jobs: list[tuple[_Key, Callable[[], object]]] = []
    numel: dict[int, int] = {}
    with _one_process_group() as group:
        for tp in tps:
            validate_strategy(arch, Strategy(tp=tp))
            say(f"tp {tp}: building the one-block shard and its {len(batches) * len(seqs)} shapes")
            ctx = ParallelContext(Strategy(tp=tp), Coord(0, 0, 0), (0,), (0,), (0,), tp_group=group if tp > 1 else None)
            torch.manual_seed(0)
            module = StageModule(one_block, ctx, torch_dtype, device)
            for p in module.parameters():
                torch.nn.init.normal_(p, std=0.02)
            block = module.layers["0"]
            params = [p for p in block.parameters()]
            if tp == 1:
                optimizer = torch.optim.AdamW([p.detach().clone().float().requires_grad_() for p in params], lr=1e-5)
                for p in optimizer.param_groups[0]["params"]:
                    p.grad = torch.zeros_like(p)
                numel[tp] = sum(p.numel() for p in params)
                jobs.append((("optimizer_step", 1, 1, 1), optimizer.step))
            for batch in batches:
                for seq in seqs:
                    jobs += _shape_jobs(module, block, batch, seq, tp, device)
        timed = _timed_rounds(jobs, repeats, sync, say)
    entries = [ProfileEntry("optimizer_step_per_param", 1, 1, 1, timed[("optimizer_step", 1, 1, 1)] / numel[1])]
    for (op, tp, b, s), seconds in timed.items():
        if op in ("optimizer_step", "block_forward_backward", "head_forward_backward"):
            continue
        entries.append(ProfileEntry(op, tp, b, s, seconds))
        if op in ("block_forward", "head_forward"):  # backward = (forward + backward) - forward, at least a forward
            both = timed[(op.replace("forward", "forward_backward"), tp, b, s)]
            entries.append(ProfileEntry(op.replace("forward", "backward"), tp, b, s, max(both - seconds, seconds)))
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores)",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": repeats, "timing": "round-robin",
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    return Profile(f"{cluster}--{dtype}", cluster, dtype, arch, entries, meta)


def _shape_jobs(module: StageModule, block: torch.nn.Module, batch: int, seq: int, tp: int,
                device: str) -> list[tuple[_Key, Callable[[], object]]]:
    """((op, tp, batch, seq), callable) for every piece at one (batch, seq); the head and embedding are keyed by tokens."""
    cfg = module.cfg
    tokens = batch * seq
    packed = PackedBatch.from_seqlens([seq] * batch, device=device)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), device=device)
    hidden = torch.randn(tokens, cfg.hidden_size, dtype=module.dtype, device=device)
    rope: RopeTables | None
    match cfg.traits.positions:
        case "rope":
            rope = rope_tables(packed.positions, cfg.head_dim, cfg.rope_theta, module.dtype, cfg.rope_scaling)
        case "learned":
            rope = None
        case _:
            assert_never(cfg.traits.positions)
    cache = module.new_cache(batch, seq + 1)
    # One decoding step against ``seq`` cached tokens per sequence (a separate cache: prefill refills its own).
    step_cache = module.new_cache(batch, seq + 1)
    step_lengths = torch.full((batch,), seq, dtype=torch.int64, device=device)
    step = PackedBatch.decode_step(step_lengths.clone())
    step_rope = (rope_tables(step.positions, cfg.head_dim, cfg.rope_theta, module.dtype, cfg.rope_scaling)
                 if rope is not None else None)
    one = hidden[:batch]
    x = hidden.clone().requires_grad_()

    def no_grad(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad():
                fn()
        return run

    def prefill() -> None:
        block(hidden, packed, rope, cache, Prefill())

    def decode() -> None:
        block(one, step, step_rope, step_cache, Decode(step_lengths, seq))

    def block_forward_backward() -> None:
        y = block(x, packed, rope, None, None)
        y.backward(torch.ones_like(y))

    def head_forward_backward() -> None:
        torch.autograd.backward(_head(module, x).float().logsumexp(-1).sum())

    jobs: list[tuple[_Key, Callable[[], object]]] = []
    if tp == 1:
        jobs.append((("embed_forward", 1, tokens, 1), no_grad(lambda: module.embed(ids))))
    jobs += [(("block_forward", tp, batch, seq), no_grad(lambda: block(hidden, packed, rope, None, None))),
             (("head_forward", tp, tokens, 1), no_grad(lambda: _head(module, hidden))),
             (("prefill", tp, batch, seq), no_grad(prefill)),
             (("decode_step", tp, batch, seq), no_grad(decode)),
             (("block_forward_backward", tp, batch, seq), block_forward_backward),
             (("head_forward_backward", tp, tokens, 1), head_forward_backward)]
    return jobs


def _head(module: StageModule, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and the LM head (or the critic's score) of the last stage."""
    h = module.final_norm(hidden)
    if module.cfg.is_critic:
        return F.linear(h, module.score.weight)
    return lm_logits(h, module.head_weight, module.ctx)
