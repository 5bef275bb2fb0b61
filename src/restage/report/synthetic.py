"""A synthetic PPO-like run log, for the report's tests, benchmark and docs.

The iteration on ``world_size`` ranks (split in two halves, lo and hi) mimics a searched PPO plan:

1. reallocation of the actor from its training layout (lo, tp) to its generation layout (all, dp)
2. ``actor_gen`` on every rank
3. transfer of the sequences to both halves
4. ``ref_inf`` on lo, while ``reward_inf`` then ``critic_inf`` run on hi
5. transfer of the rewards and values to the trainers
6. ``actor_train`` on lo, while ``critic_train`` runs on hi

With ``noise=0`` every duration is exactly its base value below, so tests can check the report
against numbers worked out by hand (step time 2.4 s, see ``BASE_SECONDS``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from restage.report.log_writer import LogWriter

BASE_SECONDS = {"realloc": 0.05, "actor_gen": 1.0, "transfer": 0.02, "ref_inf": 0.3, "reward_inf": 0.25,
                "critic_inf": 0.25, "actor_train": 0.8, "critic_train": 0.7, "master": 0.01}
# Estimator's prediction as a multiple of the base (so error_percent is 100 * (factor - 1) at noise 0).
PREDICTED_FACTOR = {"actor_gen": 0.9, "ref_inf": 1.1, "reward_inf": 1.0, "critic_inf": 1.2, "actor_train": 0.95,
                    "critic_train": 1.05}
MODELS = {"actor_gen": ("actor", "generate"), "ref_inf": ("ref", "inference"), "reward_inf": ("reward", "inference"),
          "critic_inf": ("critic", "inference"), "actor_train": ("actor", "train_step"),
          "critic_train": ("critic", "train_step")}
PEAK_MEMORY_BYTES = {"actor_gen": 30e9, "ref_inf": 18e9, "reward_inf": 17e9, "critic_inf": 17e9, "actor_train": 60e9,
                     "critic_train": 55e9}
PARAMS = 7e9
SEQ_TOKENS = 256
SAMPLES_PER_RANK = 8
EVAL_EVERY = 10
PEAK_FLOPS_BF16 = 312e12


def layouts(world_size: int) -> dict[str, str]:
    half = world_size // 2
    return {"all": f"[0-{world_size - 1}]dp{world_size}tp1pp1", "lo": f"[0-{half - 1}]dp1tp{half}pp1",
            "hi": f"[{half}-{world_size - 1}]dp{half}tp1pp1"}


def synthetic_schedule(world_size: int) -> dict:
    """The parts of a schedule the report reads: each MFC's name and the estimator's predictions."""
    return {"format_version": 1, "mfcs": [
        {"name": name, "model": MODELS[name][0], "kind": MODELS[name][1],
         "predicted": {"seconds": BASE_SECONDS[name] * factor, "peak_memory_bytes": int(PEAK_MEMORY_BYTES[name] * 0.9)}}
        for name, factor in PREDICTED_FACTOR.items()]}


def synthetic_cluster(world_size: int) -> dict:
    """The fields of ``ClusterSpec.to_json()`` the report reads (A100 figures)."""
    return {"name": f"synthetic-{world_size}xA100", "device": "A100-80GB", "nodes": max(1, world_size // 8),
            "devices_per_node": min(world_size, 8), "memory_bytes": 80 * 2**30, "peak_fp32_flops_per_second": 19.5e12,
            "peak_bf16_flops_per_second": PEAK_FLOPS_BF16, "peak_fp16_flops_per_second": PEAK_FLOPS_BF16}


def _write_step(writer: LogWriter, step: int, steps: int, step_start: float, rng: np.random.Generator,
                noise: float) -> float:
    """Record one iteration starting at ``step_start``; return its end."""
    world_size = writer.world_size
    half = world_size // 2
    lo, hi, everyone = range(half), range(half, world_size), range(world_size)
    lay = layouts(world_size)
    rank_time = dict.fromkeys(everyone, step_start)

    def seconds(name: str) -> float:
        return BASE_SECONDS[name] * max(0.1, 1.0 + noise * rng.standard_normal())

    def run(name: str, ranks: range, tokens_per_rank: int, flops_per_token: float) -> None:
        begin = max(rank_time[r] for r in ranks)  # an MFC starts once all its ranks are free
        for r in ranks:
            start = begin + abs(noise) * 0.01 * rng.random()
            end = start + seconds(name)
            memory = int(PEAK_MEMORY_BYTES[name] * (1.0 + 0.01 * noise * rng.standard_normal()))
            writer.mfc(step, name, *MODELS[name], r, start, end, tokens_per_rank, flops_per_token * tokens_per_rank, memory)
            rank_time[r] = end

    def occupy(ranks: range, name: str) -> tuple[float, float]:
        """(begin, end) of a move over ``ranks`` once all of them are free; they are busy until its end."""
        begin = max(rank_time[r] for r in ranks)
        end = begin + seconds(name)
        rank_time.update(dict.fromkeys(ranks, end))
        return begin, end

    def realloc(name: str, src: str, dst: str, ranks: range, num_bytes: int) -> None:
        begin, end = occupy(ranks, "realloc")  # one row for the whole group: src and dst meshes together are its ranks
        writer.realloc(step, name, src, dst, num_bytes, begin, end)

    def transfer(name: str, src: str, dst: str, ranks: range, num_bytes: int) -> None:
        begin, end = occupy(ranks, "transfer")
        for r in ranks:  # one row per rank taking part, as each rank times its own part
            writer.transfer(step, name, src, dst, num_bytes // len(ranks), begin, end, rank=r)

    samples = SAMPLES_PER_RANK * world_size
    tokens = samples * SEQ_TOKENS
    realloc("actor", lay["lo"], lay["all"], everyone, int(2 * PARAMS))
    run("actor_gen", everyone, tokens // world_size, 2 * PARAMS)
    transfer("seqs", lay["all"], lay["lo"], lo, tokens * 4)
    transfer("seqs", lay["all"], lay["hi"], hi, tokens * 4)
    run("ref_inf", lo, tokens, 2 * PARAMS / half)  # tp over the half: every rank sees all tokens, 1/half of the weights
    run("reward_inf", hi, tokens // half, 2 * PARAMS)
    run("critic_inf", hi, tokens // half, 2 * PARAMS)
    transfer("rewards", lay["hi"], lay["lo"], everyone, samples * SEQ_TOKENS * 8)
    run("actor_train", lo, tokens, 6 * PARAMS / half)
    run("critic_train", hi, tokens // half, 6 * PARAMS)
    step_end = max(rank_time.values()) + seconds("master")
    flops = 2 * PARAMS * tokens * 4 + 6 * PARAMS * tokens * 2  # gen, ref, reward, critic inference; two trains
    progress = (step - 1) / max(1, steps - 1)
    # Named as the runtime names them: a train MFC's own loss; prepare_train's reward and KL under every train MFC.
    reward = -1.0 + 2.0 * progress + 0.1 * noise * rng.standard_normal()
    values = {"actor_train/loss": 0.5 * np.exp(-3 * progress) + 0.02 * noise * rng.standard_normal(),
              "critic_train/loss": 1.0 * np.exp(-2 * progress) + 0.02 * noise * rng.standard_normal(),
              "actor_train/reward": reward, "critic_train/reward": reward}
    if step >= 3:  # a statistic that appears after the first steps, as an adaptive KL controller's would
        values["actor_train/kl"] = values["critic_train/kl"] = 0.05 * progress + 0.005 * abs(noise * rng.standard_normal())
    if step % EVAL_EVERY == 0 or step == steps:  # an evaluation of held-out prompts (run.eval_every)
        values |= {"eval/reward": 0.8 * reward, "eval/accuracy": max(0.0, 0.5 * progress), "eval/length": 6.0,
                   "eval/prompts": 20.0}
    writer.stats(step, values)
    writer.end_step(step, step_start, step_end, samples, tokens, flops)
    return step_end


def write_synthetic_log(path: str | Path, steps: int = 200, world_size: int = 8, seed: int = 0, noise: float = 0.05,
                        start_unix_seconds: float = 1.7e9, close: bool = True) -> Path:
    """Write a PPO-like log of ``steps`` steps on ``world_size`` (even, >= 2) ranks; return the log path."""
    if world_size < 2 or world_size % 2:
        raise ValueError("the synthetic plan splits the ranks in two halves: give an even world_size >= 2")
    rng = np.random.default_rng(seed)
    writer = LogWriter(path, world_size=world_size, config={"experiment": "synthetic-ppo", "world_size": world_size},
                       schedule=synthetic_schedule(world_size), cluster=synthetic_cluster(world_size), dtype="bf16",
                       overwrite=True)
    clock = start_unix_seconds
    for step in range(1, steps + 1):  # steps count from 1
        clock = _write_step(writer, step, steps, clock, rng, noise)
    if close:
        writer.close()
    else:
        writer.abort()
    return writer.path
