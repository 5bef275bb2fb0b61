"""Shared pieces of the algorithms' MFC declarations: sizes read from the config."""

from __future__ import annotations

from restage.config import ExperimentConfig


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
