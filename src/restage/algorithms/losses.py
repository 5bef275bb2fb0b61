"""Loss functions: pure torch over packed, token-aligned tensors (see ``ops`` for the alignment)."""

from __future__ import annotations

from typing import Literal, assert_never, get_args

import torch
import torch.nn.functional as F

from restage.algorithms import (
    aggregations,  # noqa: F401  (fills registry.AGGREGATIONS)
    registry,
)

KlEstimator = Literal["k1", "k2", "k3"]  # algo.kl_estimator
KL_ESTIMATORS: tuple[KlEstimator, ...] = get_args(KlEstimator)
DpoLossType = Literal["dpo", "ipo"]  # algo.loss_type


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, mode: str = "token_mean",
              norm_tokens: int = 0, norm: registry.LossNorm | None = None) -> torch.Tensor:
    """Scalar loss from per-token terms by the registered aggregation ``mode`` (``registry.AGGREGATIONS``:
    ``token_mean``, ``seq_mean``, ...); ``norm_tokens`` is the generation's ``max_new_tokens`` (Dr. GRPO's norm),
    ``norm`` the train step's counts (``registry.LossNorm``; None: this micro-batch's)."""
    if mode not in registry.AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {registry.names(registry.AGGREGATIONS)}, got {mode!r}")
    return registry.AGGREGATIONS[mode](per_token, mask, cu_seqlens, norm_tokens, norm)


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the tokens where ``loss_mask`` (the answer)."""
    m = loss_mask.to(logprobs.dtype)
    return -(logprobs * m).sum() / m.sum().clamp(min=1)


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean ``-log sigmoid(chosen - rejected)``, accuracy) over pairs; see ``pair_accuracy``."""
    margin = chosen.float() - rejected.float()
    return -F.logsigmoid(margin).mean(), pair_accuracy(margin)


def pair_accuracy(margin: torch.Tensor) -> torch.Tensor:
    """Fraction of pairs ranked right (margin > 0); a tie counts one half, so an untrained model scores 0.5."""
    margin = margin.detach().float()
    return ((margin > 0).float() + 0.5 * (margin == 0).float()).mean()


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float, loss_type: DpoLossType = "dpo",
             label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO (or IPO) loss from sequence log-probs, and the implicit rewards of chosen and rejected.

    With ``h = (pi_c - ref_c) - (pi_r - ref_r)``: DPO is ``-log sigmoid(beta h)`` (label smoothing ``e``
    mixes in ``-log sigmoid(-beta h)`` with weight ``e``); IPO is ``(h - 1 / (2 beta))^2``.
    The implicit rewards are ``beta (pi - ref)``.
    """
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    match loss_type:
        case "dpo":
            loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
        case "ipo":
            loss = (h - 1 / (2 * beta)) ** 2
        case unknown:
            assert_never(unknown)
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KlEstimator = "k1") -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from samples of the policy (Schulman's k1, k2, k3).

    With ``d = ref - logp``: k1 = ``-d``; k2 = ``d^2 / 2``; k3 = ``exp(d) - d - 1`` (unbiased, always >= 0).
    """
    d = ref_logprobs - logprobs
    match kind:
        case "k1":
            return -d
        case "k2":
            return 0.5 * d * d
        case "k3":
            return torch.exp(d) - d - 1
        case unknown:
            assert_never(unknown)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cu_seqlens: torch.Tensor, clip_eps: float, agg: str = "token_mean",
                norm_tokens: int = 0) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate ``max(-A r, -A clip(r, 1-eps, 1+eps))`` with ``r = exp(logp - old_logp)``.

    Returns the aggregated loss and statistics over the masked tokens: ``clip_fraction``,
    ``approx_kl`` (k3 of old vs new), ``ratio_mean``, ``ratio_max`` and ``ratio_dev`` (mean of
    ``max(r, 1/r)``, the early-stop signal).
    """
    per_token, stats = _clipped_surrogate(logprobs, old_logprobs, advantages, mask, clip_eps)
    return aggregate(per_token, mask, cu_seqlens, agg, norm_tokens), stats


def _clipped_surrogate(logprobs: torch.Tensor, anchor_logprobs: torch.Tensor, advantages: torch.Tensor,
                       mask: torch.Tensor, clip_eps: float, clip_high: float | None = None) -> tuple[torch.Tensor, dict]:
    """Per-token ``max(-A r, -A clip(r, 1-eps, 1+high))``, ``r = exp(logp - anchor_logp)``, and its ratio statistics
    (``clip_high`` None: ``clip_eps`` on both sides)."""
    log_ratio = (logprobs - anchor_logprobs).masked_fill(~mask, 0.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + (clip_eps if clip_high is None else clip_high))
    with torch.no_grad():
        m = mask.float()
        count = m.sum().clamp(min=1)
        lr = log_ratio.detach()
        stats = {
            "clip_fraction": float(((clipped > unclipped).float() * m).sum() / count),
            "approx_kl": float(((torch.exp(lr) - lr - 1) * m).sum() / count),
            "ratio_mean": float((ratio.detach() * m).sum() / count),
            "ratio_max": float(ratio.detach()[mask].max()) if bool(mask.any()) else 1.0,
            "ratio_dev": float((torch.exp(lr.abs()) * m).sum() / count),
        }
    return torch.maximum(unclipped, clipped), stats


def behaviour_weights(prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
                      cap: float) -> tuple[torch.Tensor, dict]:
    """``[T]`` importance weights ``w = exp(prox_logp - behav_logp)`` of the masked tokens, and their statistics.

    A constant (no gradient flows through it). A masked token whose weight exceeds ``cap`` is dropped
    (weight 0), as AReaL's ``behav_imp_weight_cap`` does; ``cap`` 0 keeps every token. Off ``mask``: 0.
    Statistics over the masked tokens: ``behav_imp_weight_mean`` and ``behav_imp_weight_max`` (before the
    cap) and ``behav_imp_weight_dropped`` (the fraction the cap dropped).
    """
    with torch.no_grad():
        raw = torch.exp((prox_logprobs.detach() - behav_logprobs.detach()).masked_fill(~mask, 0.0))
        kept = mask & (raw <= cap) if cap > 0 else mask
        m = mask.float()
        count = m.sum().clamp(min=1)
        stats = {
            "behav_imp_weight_mean": float((raw * m).sum() / count),
            "behav_imp_weight_max": float(raw[mask].max()) if bool(mask.any()) else 1.0,
            "behav_imp_weight_dropped": float((mask & ~kept).float().sum() / count),
        }
        return torch.where(kept, raw, torch.zeros_like(raw)), stats


def decoupled_policy_loss(logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
                          advantages: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, clip_eps: float,
                          weight_cap: float, agg: str = "token_mean", norm_tokens: int = 0) -> tuple[torch.Tensor, dict]:
    """Decoupled PPO (Hilton et al. 2021; AReaL, Fu et al. 2025): ``w * max(-A r, -A clip(r, 1-eps, 1+eps))``.

    ``r = exp(logp - prox_logp)`` is clipped against the proximal policy (the weights before this
    train step) and ``w = exp(prox_logp - behav_logp)`` (``behaviour_weights``: a constant, capped by
    dropping) corrects for the older policy that sampled the tokens. A dropped token keeps its place in
    the aggregation's denominator (as in AReaL). With ``prox == behav`` every weight is exactly 1 and
    the loss is ``policy_loss(logprobs, behav_logprobs, ...)``. Statistics: ``policy_loss``'s (of ``r``)
    and ``behaviour_weights``'.
    """
    per_token, stats = _clipped_surrogate(logprobs, prox_logprobs, advantages, mask, clip_eps)
    weights, weight_stats = behaviour_weights(prox_logprobs, behav_logprobs, mask, weight_cap)
    return aggregate(weights * per_token, mask, cu_seqlens, agg, norm_tokens), stats | weight_stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_eps: float, norm: registry.LossNorm | None = None) -> tuple[torch.Tensor, float]:
    """Clipped value loss ``0.5 max((v - R)^2, (v_old + clip(v - v_old, -eps, eps) - R)^2)``, token mean (over the
    train step's tokens with ``norm``, ``registry.LossNorm``; else over the micro-batch's).

    ``clip_eps <= 0`` turns clipping off. Returns the loss and the fraction of tokens where the clipped term won.
    """
    err = (values - returns) ** 2
    if clip_eps > 0:
        clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
        err_clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(err, err_clipped)
        frac = float(((err_clipped > err).float() * mask).sum() / mask.sum().clamp(min=1))
    else:
        per_token, frac = err, 0.0
    m = mask.to(values.dtype)
    denominator = m.sum() if norm is None else torch.tensor(norm.tokens, dtype=values.dtype)
    return 0.5 * (per_token * m).sum() / denominator.clamp(min=1), frac
