"""Reward modelling: pairwise Bradley-Terry loss on chosen / rejected answers."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import base, losses, packed_ops
from restage.algorithms._graphs import REWARD_TRAIN, sizes
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC, MFCKind


@dataclass(frozen=True)
class Params:
    """Reward modelling has no hyper-parameters of its own."""


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    # Each pair is two sequences (chosen, rejected).
    return [MFC(REWARD_TRAIN, MFCKind.TRAIN_STEP, "reward", ("packed_pair_ids", "prompt_mask"), (), 2 * s["prompts"],
                s["prompt_tokens"], s["answer_tokens"], s["micro_batches"])]


def validate(cfg: ExperimentConfig) -> Params:
    return base.parse_params(Params, cfg)


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return ("values",)


def pair_scores(values: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores: the scalar head at each sequence's last token; pairs are consecutive."""
    scores = packed_ops.last_token(values, batch.cu_seqlens).float()
    return scores[0::2], scores[1::2]


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    chosen, rejected = pair_scores(outputs["values"], micro_batch)
    value, accuracy = losses.bradley_terry(chosen, rejected)
    return value, {"loss": float(value.detach()), "accuracy": float(accuracy), "chosen_score": float(chosen.detach().mean()),
                   "rejected_score": float(rejected.detach().mean()), "pairs": float(chosen.numel())}
