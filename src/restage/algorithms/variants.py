"""The built-in advantage estimators and policy losses (``registry``; the aggregations are ``aggregations.py``);
docs/algorithms.md has each one's paper and config keys. Every function takes the answer-token mask as given: a
token the mask leaves out (a prompt token, or an observation token of a multi-turn episode) gets no advantage, no loss and no count.
"""

from __future__ import annotations

import torch

from restage.algorithms import estimators, losses, packed_ops
from restage.algorithms.registry import AdvantageInputs, register_advantage, register_policy_loss

# -- advantages ------------------------------------------------------------------------------------------------


def _on_tokens(seq_advantages: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    return packed_ops.broadcast_seq(seq_advantages.float(), ctx.cu_seqlens) * ctx.mask


def _kl_charged(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    """The sequence rewards less ``kl_coef`` x each answer's summed KL (``kl_in_reward``; ``kl_coef`` is 0 otherwise):
    how a sequence-level estimator takes the KL into its reward, as TRL's RLOOTrainer does (``rewards - beta * kl``,
    the per-token KL summed over the answer) before the baseline is subtracted."""
    if ctx.kl_coef == 0:
        return rewards.float()
    return rewards.float() - ctx.kl_coef * packed_ops.seq_sum(ctx.token_kl.float() * ctx.mask, ctx.cu_seqlens)


@register_advantage("grpo")
def grpo(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    """Shao et al. 2024 (DeepSeekMath): ``(r - mean_group) / (std_group + eps)`` on every answer token."""
    return _on_tokens(estimators.group_normalise(_kl_charged(rewards, ctx), ctx.group_size, ctx.eps, use_std=True), ctx)


@register_advantage("dr_grpo")
def dr_grpo(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    """Liu et al. 2025 (Understanding R1-Zero-Like Training): ``r - mean_group``, no division by the group's std.
    (Dr. GRPO's other half, no division by the answer length, is ``loss_agg: seq_mean_token_sum_norm``.)"""
    return _on_tokens(estimators.group_normalise(_kl_charged(rewards, ctx), ctx.group_size, ctx.eps, use_std=False),
                      ctx)


@register_advantage("rloo")
def rloo(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    """Ahmadian et al. 2024 (Back to Basics, after Kool et al. 2019): ``r_i - mean_{j != i} r_j`` within the group,
    which is ``G / (G - 1) (r_i - mean_group)``. A group of one gets 0."""
    g = ctx.group_size
    if g == 1:
        return torch.zeros_like(ctx.mask, dtype=torch.float32)
    grouped = _kl_charged(rewards, ctx).view(-1, g)
    leave_one_out = (grouped.sum(-1, keepdim=True) - grouped) / (g - 1)
    return _on_tokens((grouped - leave_one_out).view(-1), ctx)


def _reinforce_pp(seq_rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    token_rewards = estimators.kl_shaped_token_rewards(seq_rewards, ctx.token_kl, ctx.mask, ctx.cu_seqlens, ctx.kl_coef)
    returns = estimators.returns_to_go(token_rewards, ctx.mask, ctx.cu_seqlens)
    return packed_ops.masked_whiten(returns, ctx.mask, eps=ctx.eps, reduce=ctx.reduce) * ctx.mask


@register_advantage("reinforce_pp")
def reinforce_pp(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    """Hu 2025 (REINFORCE++): per-token returns of the reward (minus ``kl_coef`` times the per-token KL with
    ``kl_in_reward``), whitened over the whole batch (every dp rank's tokens): no per-prompt baseline."""
    return _reinforce_pp(rewards.float(), ctx)


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor:
    """REINFORCE++-baseline (Hu 2025, OpenRLHF's ``reinforce_baseline``): the group mean is subtracted from each
    reward first, then as ``reinforce_pp`` (KL-shaped returns whitened over the whole batch)."""
    return _reinforce_pp(estimators.group_normalise(rewards, ctx.group_size, ctx.eps, use_std=False), ctx)


# -- policy losses ---------------------------------------------------------------------------------------------


@register_policy_loss("ppo")
def ppo_clip(logprobs: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
             cu_seqlens: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict]:
    """Schulman et al. 2017: per token ``max(-A r, -A clip(r, 1 - low, 1 + high))``, ``r = exp(logp - anchor)``;
    ``clip_eps_low`` < ``clip_eps_high`` is DAPO's decoupled clip (Yu et al. 2025, "clip-higher")."""
    return losses._clipped_surrogate(logprobs, anchor, advantages, mask, clip_low, clip_high)


@register_policy_loss("gspo")
def gspo(logprobs: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         cu_seqlens: torch.Tensor, clip_low: float, clip_high: float) -> tuple[torch.Tensor, dict]:
    """Zheng et al. 2025 (Group Sequence Policy Optimization): one ratio per sequence,
    ``s = exp(mean over its answer tokens of (logp - anchor))``, clipped as a whole; the sequence's loss
    ``max(-A s, -A clip(s, 1 - low, 1 + high))`` stands on each of its answer tokens (so ``seq_mean`` gives
    the paper's mean over sequences). The paper's clip range is small (3e-4 / 4e-4)."""
    log_ratio = (logprobs - anchor).masked_fill(~mask, 0.0)
    m = mask.to(log_ratio.dtype)
    seq_log_ratio = packed_ops.seq_sum(log_ratio, cu_seqlens) / packed_ops.seq_sum(m, cu_seqlens).clamp(min=1)
    # anchor + the sequence's mean log-ratio on every token: _clipped_surrogate's ratio is then s, per token.
    per_token_log_ratio = packed_ops.broadcast_seq(seq_log_ratio, cu_seqlens)
    per_token, stats = losses._clipped_surrogate(per_token_log_ratio, torch.zeros_like(per_token_log_ratio),
                                                 advantages, mask, clip_low, clip_high)
    return per_token, stats
