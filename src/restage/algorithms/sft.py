"""Supervised fine-tuning: masked next-token loss on the answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import base, losses
from restage.algorithms._graphs import sizes
from restage.config import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC, DataflowGraph


@dataclass(frozen=True)
class Params:
    """SFT has no hyper-parameters of its own (learning rate etc. live under models.actor.optim)."""


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    return [MFC("actor_train", "train_step", "actor", ("packed_input_ids", "prompt_mask"), (), s["prompts"],
                s["prompt_tokens"], s["answer_tokens"], s["micro_batches"])]


def validate(cfg: ExperimentConfig) -> Params:
    return base.parse_params(Params, cfg)


def init_state(cfg: ExperimentConfig, tokenizer=None) -> base.AlgoState:
    return base.AlgoState(cfg, DataflowGraph(tuple(mfcs(cfg))), validate(cfg), tokenizer)


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return ("logprobs",)


def inference(mfc_name: str, batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState) -> dict:
    raise ValueError("sft has no inference MFC")


def after_generate(mfc_name: str, batch: Batch, cfg: ExperimentConfig, state: base.AlgoState) -> Batch:
    raise ValueError("sft has no generate MFC")


def prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                  reduce=None) -> tuple[Batch, dict]:
    return batch, {}


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig,
         state: base.AlgoState) -> tuple[torch.Tensor, dict]:
    mask = base.answer_mask(micro_batch)
    value = losses.sft_loss(outputs["logprobs"], mask)
    return value, {"loss": float(value.detach()), "answer_tokens": float(mask.sum())}
