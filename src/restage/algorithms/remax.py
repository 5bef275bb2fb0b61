"""ReMax: REINFORCE with the reward of a greedy generation as the baseline; no critic.

Each prompt gets one sampled and one greedy answer. Per-token rewards are ``-kl_coef * kl_t``
(k1 against the reference) with ``reward - greedy_reward`` added on the last answer token; an
action's advantage is the (undiscounted) sum of the rewards from it to the end. With ``kl_coef`` 0
(and no reference EMA) the graph has no ``ref_inf`` MFC and the config needs no ``models.ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import _policy, base, estimators, offpolicy, packed_ops
from restage.algorithms._graphs import (
    ACTOR_GEN,
    ACTOR_GREEDY_GEN,
    ACTOR_TRAIN,
    GREEDY_REWARD_INF,
    REF_INF,
    REWARD_INF,
    reward_source,
    sizes,
    with_proximal,
)
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC, MFCKind


@dataclass(frozen=True)
class Params(_policy.KLPolicyParams):
    adv_norm: bool = False


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    n, p, g, mb = s["prompts"], s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    fn = reward_source(cfg) == "function"
    out = [
        MFC(ACTOR_GEN, MFCKind.GENERATE, "actor", ("prompts",), ("seqs", "prompt_mask", "logprobs") + (("rewards",) if fn else ()),
            n, p, g, mb),
        MFC(ACTOR_GREEDY_GEN, MFCKind.GENERATE, "actor", ("prompts",),
            ("greedy_seqs", "greedy_prompt_mask") + (("baseline_rewards",) if fn else ()), n, p, g, mb, greedy=True),
    ]
    if not fn:
        out += [
            MFC(REWARD_INF, MFCKind.INFERENCE, "reward", ("seqs", "prompt_mask"), ("rewards",), n, p, g, mb),
            MFC(GREEDY_REWARD_INF, MFCKind.INFERENCE, "reward", ("greedy_seqs", "greedy_prompt_mask"), ("baseline_rewards",),
                n, p, g, mb),
        ]
    ref = _policy.config_uses_ref(Params, cfg)
    if ref:
        out.append(MFC(REF_INF, MFCKind.INFERENCE, "ref", ("seqs", "prompt_mask"), ("ref_logprobs",), n, p, g, mb))
    train_in = ("seqs", "prompt_mask", "logprobs") + (("ref_logprobs",) if ref else ()) + ("rewards", "baseline_rewards")
    out.append(MFC(ACTOR_TRAIN, MFCKind.TRAIN_STEP, "actor", train_in, (), n, p, g, mb, options=_policy.train_options(cfg)))
    return with_proximal(cfg, out)


def validate(cfg: ExperimentConfig) -> Params:
    return _policy.validate_kl_policy(Params, cfg)


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return _policy.forward_outputs(Params, mfc_name, cfg)


def prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                  reduce: packed_ops.Reduce = None) -> tuple[Batch, dict]:
    """Adds per-token ``advantages`` (reward-to-go of the KL-shaped reward minus the greedy baseline)."""
    p: Params = state.params
    mask = base.answer_mask(batch)
    cu = batch.cu_seqlens
    rewards = _policy.shaped_rewards(batch, p)
    baseline = _policy.shaped_rewards(batch, p, "baseline_rewards")
    kl = _policy.ref_kl(batch, p, mask)
    token_rewards = estimators.kl_shaped_token_rewards(rewards - baseline, kl, mask, cu, p.kl_coef)
    advantages = estimators.returns_to_go(token_rewards, mask, cu)
    if p.adv_norm:
        advantages = packed_ops.masked_whiten(advantages, mask, reduce=reduce)
    all_seqs = torch.ones(batch.n_seqs, dtype=torch.bool)
    seq_kl, n_seqs = packed_ops.masked_sum(packed_ops.seq_sum(kl, cu), all_seqs, reduce)
    stats = {
        "reward": float(packed_ops.masked_mean(batch["rewards"].float(), all_seqs, reduce)),
        "baseline_reward": float(packed_ops.masked_mean(batch["baseline_rewards"].float(), all_seqs, reduce)),
        "answer_tokens": float(packed_ops.masked_sum(mask.float(), mask, reduce)[1]),
    }
    if _policy.uses_ref(p):  # without a reference (kl_coef 0) there is no KL to log
        stats["kl"] = float(seq_kl / n_seqs.clamp(min=1))
    return batch.with_keys(tokens={"advantages": advantages.float()}), stats


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    if mfc_name != ACTOR_TRAIN:
        raise ValueError(f"remax has no train MFC {mfc_name!r}")
    return _policy.actor_loss(micro_batch, outputs, state.params, at=offpolicy.train_version(cfg, ctx),
                              norm_tokens=cfg.generation.max_new_tokens)
