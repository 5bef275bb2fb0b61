"""Reward modelling: pairwise Bradley-Terry loss on chosen / rejected answers."""

from __future__ import annotations

from restage.algorithms._graphs import sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    # Each pair is two sequences (chosen, rejected).
    return [MFC("reward_train", "train_step", "reward", ("packed_pair_ids", "prompt_mask"), (), 2 * s["prompts"],
                s["prompt_tokens"], s["answer_tokens"], s["micro_batches"])]
