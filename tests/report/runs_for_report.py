"""Short "runs" that log like the runtime does: real timed work on one or several gloo ranks, the master writes the log.

Each rank times its MFCs with time.time(); a parameter "reallocation" (broadcast) and a data
"transfer" (send/recv) are timed on each rank taking part; rank 0 gathers every rank's rows
after the step and writes them with LogWriter, as the master role does.
"""

from __future__ import annotations

import resource
import time

import numpy as np

from restage.report.log import LogWriter

PREDICTED_SECONDS = {"actor_gen": 0.006, "ref_inf": 0.003, "reward_inf": 0.003, "actor_train": 0.009, "critic_train": 0.009}
MATRIX = 96


def _work(repeats: int, seed: int) -> float:
    """Real CPU work (matmuls); returns a checksum so it cannot be skipped."""
    a = np.random.default_rng(seed).standard_normal((MATRIX, MATRIX))
    for _ in range(repeats):
        a = np.tanh(a @ a / MATRIX)
    return float(a.sum())


def _peak_memory_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mfc(rows: list, step: int, name: str, model: str, kind: str, rank: int, repeats: int, tokens: int) -> float:
    start = time.time()
    checksum = _work(repeats, step * 100 + rank)
    end = time.time()
    flops = 2.0 * MATRIX**3 * repeats
    rows.append(("mfc", (step, name, model, kind, rank, start, end, tokens, flops, _peak_memory_bytes())))
    return checksum


def schedule(world_size: int) -> dict:
    return {"format_version": 1, "mfcs": [{"name": n, "predicted": {"seconds": s, "peak_memory_bytes": 50 * 2**20}}
                                          for n, s in PREDICTED_SECONDS.items()]}


def run(rank: int, world_size: int, path: str, steps: int = 4, samples: int = 4, seq_tokens: int = 16) -> str:
    """One short PPO-shaped run; with world_size 1 everything runs on rank 0 in order and no collectives are used."""
    dist = None
    if world_size > 1:
        import torch
        import torch.distributed as dist
    writer = LogWriter(path, world_size=world_size, config="experiment: report-test\n", schedule=schedule(world_size),
                       cluster={"device": {"peak_flops": {"fp32": 5e10}}}, dtype="fp32", overwrite=True) if rank == 0 else None
    everyone = f"[0-{world_size - 1}]dp{world_size}tp1pp1"
    tokens = samples * seq_tokens
    for step in range(steps):
        if dist:
            dist.barrier()  # the master's step start comes before any rank's work
        step_start = time.time()
        rows: list = []
        _mfc(rows, step, "actor_gen", "actor", "generate", rank, 24, tokens // world_size)
        if dist:  # reallocate the actor's "parameters": a broadcast from rank 0, timed on every rank
            params = torch.full((4096,), float(step))
            begin = time.time()
            dist.broadcast(params, src=0)
            rows.append(("realloc", (step, "actor", "[0]dp1tp1pp1", everyone, rank, params.numel() * 4, begin, time.time())))
        if rank == 0:
            _mfc(rows, step, "ref_inf", "ref", "inference", rank, 12, tokens)
        if rank == world_size - 1:
            _mfc(rows, step, "reward_inf", "reward", "inference", rank, 12, tokens)
        if dist:  # rewards go from the last rank to rank 0
            rewards = torch.zeros(samples)
            begin = time.time()
            if rank == world_size - 1:
                dist.send(torch.ones(samples), dst=0)
            elif rank == 0:
                dist.recv(rewards, src=world_size - 1)
            if rank in (0, world_size - 1):
                rows.append(("transfer", (step, "rewards", f"[{world_size - 1}]dp1tp1pp1", "[0]dp1tp1pp1", rank,
                                          samples * 4, begin, time.time())))
        if rank == 0:
            _mfc(rows, step, "actor_train", "actor", "train_step", rank, 36, tokens)
        if rank == world_size - 1:
            _mfc(rows, step, "critic_train", "critic", "train_step", rank, 36, tokens)
        gathered = [rows]
        if dist:
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            for rank_rows in gathered:
                for kind, row in rank_rows:
                    if kind == "mfc":
                        writer.mfc(*row)
                    else:
                        s, name, src, dst, r, num_bytes, begin, end = row
                        getattr(writer, kind)(s, name, src, dst, num_bytes, begin, end, rank=r)
            writer.stats(step, {"reward": 0.1 * step, "actor_loss": 1.0 / (step + 1)} | ({"kl": 0.01 * step} if step else {}))
            flops = sum(row[8] for rank_rows in gathered for kind, row in rank_rows if kind == "mfc")
            writer.end_step(step, step_start, time.time(), samples, tokens, flops)
    if rank == 0:
        writer.close()
    return path
