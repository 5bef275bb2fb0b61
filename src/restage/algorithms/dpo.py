"""Direct preference optimisation against a frozen reference model (IPO as an option)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import base, losses, packed_ops
from restage.algorithms._graphs import ACTOR_TRAIN, REF_INF, sizes
from restage.algorithms.losses import DpoLossType
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFC, MFCKind


@dataclass(frozen=True)
class Params:
    beta: float = 0.1
    loss_type: DpoLossType = "dpo"
    label_smoothing: float = 0.0  # dpo only: assumed probability that a preference label is flipped


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    n, p, a, mb = 2 * s["prompts"], s["prompt_tokens"], s["answer_tokens"], s["micro_batches"]
    return [
        MFC(REF_INF, MFCKind.INFERENCE, "ref", ("packed_pair_ids", "prompt_mask"), ("ref_logprobs",), n, p, a, mb),
        MFC(ACTOR_TRAIN, MFCKind.TRAIN_STEP, "actor", ("packed_pair_ids", "prompt_mask", "ref_logprobs"), (), n, p, a, mb),
    ]


def validate(cfg: ExperimentConfig) -> Params:
    params = base.parse_params(Params, cfg)
    base.check_positive(params, "beta")
    if not 0.0 <= params.label_smoothing < 0.5:
        raise ConfigError(f"algo.label_smoothing: {params.label_smoothing} must be in [0, 0.5)")
    return params


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return ("logprobs",)


def pair_logprobs(logprobs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) sequence log-probs: answer-token log-probs summed per sequence; pairs are consecutive."""
    mask = base.answer_mask(batch)
    per_seq = packed_ops.seq_sum(logprobs.float() * mask, batch.cu_seqlens)
    return per_seq[0::2], per_seq[1::2]


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    p = state.params
    pi_c, pi_r = pair_logprobs(outputs["logprobs"], micro_batch)
    ref_c, ref_r = pair_logprobs(micro_batch["ref_logprobs"], micro_batch)
    per_pair, reward_c, reward_r = losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, p.beta, p.loss_type, p.label_smoothing)
    value = per_pair.mean()
    margin = reward_c - reward_r
    # accuracy: the implicit reward ranks the pair right; policy_accuracy: the policy alone gives chosen more probability.
    return value, {"loss": float(value.detach()), "accuracy": float(losses.pair_accuracy(margin)),
                   "policy_accuracy": float(losses.pair_accuracy(pi_c - pi_r)), "margin": float(margin.mean()),
                   "chosen_reward": float(reward_c.mean()), "rejected_reward": float(reward_r.mean()),
                   "pairs": float(pi_c.numel())}
