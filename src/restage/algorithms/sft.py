"""Supervised fine-tuning: masked next-token loss on the answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import base, losses
from restage.algorithms._graphs import ACTOR_TRAIN, sizes
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC, MFCKind


@dataclass(frozen=True)
class Params:
    """SFT has no hyper-parameters of its own (learning rate etc. live under models.actor.optim)."""


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    return [MFC(ACTOR_TRAIN, MFCKind.TRAIN_STEP, "actor", ("packed_input_ids", "prompt_mask"), (), s["prompts"],
                s["prompt_tokens"], s["answer_tokens"], s["micro_batches"])]


def validate(cfg: ExperimentConfig) -> Params:
    return base.parse_params(Params, cfg)


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return ("logprobs",)


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    mask = base.answer_mask(micro_batch)
    value = losses.sft_loss(outputs["logprobs"], mask)
    return value, {"loss": float(value.detach()), "answer_tokens": float(mask.sum())}
