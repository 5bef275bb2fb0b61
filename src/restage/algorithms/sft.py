"""Supervised fine-tuning: masked next-token loss on the answer."""

from __future__ import annotations

from restage.algorithms._graphs import sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    return [MFC("actor_train", "train_step", "actor", ("packed_input_ids", "prompt_mask"), (), s["prompts"],
                s["prompt_tokens"], s["answer_tokens"], s["micro_batches"])]
