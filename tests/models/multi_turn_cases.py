"""Shared pieces of the multi-turn rollout tests: the calculator task's tiny model and config, a scripted
environment (every answer gets an observation until the third), and one call of ``run_episodes``."""

from __future__ import annotations

import threading
import time

from restage.algorithms.base import CallContext
from restage.algorithms.environments import EpisodeContext, StepResult, register_environment
from restage.algorithms.interface import get_algorithm
from restage.config.load import config_from_dict
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch, pack_sequences
from restage.data.tokenizer import load_tokenizer
from restage.runtime.step.multi_turn import generate_batch

PROMPTS = ["compute 4 7 * 8 3 :", "compute 1 2 * 3 4 :", "compute 9 9 * 1 0 :"]
TIMELINE: list[tuple[str, int, int, float]] = []  # (event, sample id, turn, seconds): the scripted env's steps
STARTED: dict[int, threading.Event] = {}  # sample id -> set once its first step began
WAITED: dict[int, bool] = {}


class Scripted:
    """Observation ``<result> 7 </result>`` after the first two answers, done after the third; reward 0.5 a step.
    ``delays[sample id]`` seconds of sleep in its first step (a slow tool); ``waits[sample id] = other``: its first
    step waits (at most 60 s) until sample ``other``'s first step has begun, and records in ``WAITED`` whether it
    had."""

    delays: dict[int, float] = {}
    waits: dict[int, int] = {}

    def __init__(self, ctx: EpisodeContext):
        self.ctx, self.turn = ctx, 0

    def reset(self):
        return self.ctx.prompt

    def step(self, answer: str) -> StepResult:
        TIMELINE.append(("start", self.ctx.sample_id, self.turn, time.monotonic()))
        if self.turn == 0:
            STARTED.setdefault(self.ctx.sample_id, threading.Event()).set()
            time.sleep(self.delays.get(self.ctx.sample_id, 0.0))
            if self.ctx.sample_id in self.waits:
                other = STARTED.setdefault(self.waits[self.ctx.sample_id], threading.Event())
                WAITED[self.ctx.sample_id] = other.wait(timeout=60)
        self.turn += 1
        TIMELINE.append(("end", self.ctx.sample_id, self.turn - 1, time.monotonic()))
        return StepResult("<result> 7 </result>", 0.5, self.turn >= 3)


register_environment("scripted", Scripted)


def config(model: str, tokenizer: str, **environment) -> ExperimentConfig:
    env = {"name": "scripted", "max_turns": 3, "max_episode_tokens": 40, **environment}
    return config_from_dict({
        "experiment": "t", "algorithm": "grpo", "reward_fn": "restage.data.arith:reward", "environment": env,
        "algo": {"group_size": 2, "kl_coef": 0.0}, "models": {"actor": {"path": model, "trainable": True}},
        "dataset": {"path": "x", "tokenizer": tokenizer, "max_prompt_tokens": 9},
        "generation": {"max_new_tokens": 12, "temperature": 1.0, "max_slots": 8}})


def prompts_batch(tokenizer) -> Batch:
    ids = [[tokenizer.bos_token_id] + tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return pack_sequences(ids, key="prompts", ids=[10, 11, 12])


def episodes(module, cfg: ExperimentConfig, seed: int = 5, version: int | None = None):
    """``generate_batch`` of ``PROMPTS`` under ``cfg`` (the runtime's call); the result."""
    tokenizer = load_tokenizer(cfg.dataset.tokenizer)
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    return generate_batch(module, state.graph["actor_gen"], prompts_batch(tokenizer), algo, cfg, state,
                          CallContext(), seed, version)


def sequences(batch: Batch) -> list[tuple[list[int], list[int]]]:
    """Each episode's (tokens, policy mask)."""
    out, start = [], 0
    for n in batch.seqlens:
        out.append((batch["seqs"][start:start + n].tolist(), (~batch["prompt_mask"][start:start + n]).int().tolist()))
        start += n
    return out
