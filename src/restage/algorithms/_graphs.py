"""Shared pieces of the algorithms' MFC declarations: the MFC names, and sizes read from the config.

Code that picks behaviour by MFC (``forward_outputs``, ``loss``) compares against these names,
so renaming an MFC is one edit here.
"""

from __future__ import annotations

from restage.config import ExperimentConfig

ACTOR_GEN = "actor_gen"
ACTOR_GREEDY_GEN = "actor_greedy_gen"
REWARD_INF = "reward_inf"
GREEDY_REWARD_INF = "greedy_reward_inf"
REF_INF = "ref_inf"
CRITIC_INF = "critic_inf"
ACTOR_TRAIN = "actor_train"
CRITIC_TRAIN = "critic_train"
REWARD_TRAIN = "reward_train"


def sizes(cfg: ExperimentConfig) -> dict:
    """Batch and sequence sizes every algorithm's MFCs are built from."""
    return {
        "prompts": cfg.run.batch_size,
        "prompt_tokens": cfg.dataset.max_prompt_tokens,
        "gen_tokens": cfg.generation.max_new_tokens,
        "answer_tokens": cfg.dataset.max_answer_tokens,
        "micro_batches": cfg.run.micro_batches,
    }


def reward_source(cfg: ExperimentConfig) -> str:
    """``function`` when a rule-based reward is configured, else ``model`` (a reward model MFC)."""
    return "function" if cfg.reward_fn else "model"
