"""Importance-sampling correction between the generation layout's log-probs and the training layout's.

The generating layout (its own tp/pp cut, a KV-cached decoder, its kernels) and the training layout compute the
same policy's log-probs with different rounding, so the tokens are sampled from a slightly different policy than
the one trained. With ``algo.is_correction`` set, the graph gains ``actor_prox`` (``_graphs.with_proximal``): the
training layout recomputes the log-probs of the weights that generated (``prox_logprobs``); the surrogate is
clipped against them and each token weighted by ``w = exp(prox - gen)`` (a constant):

* ``tis`` (truncated importance sampling; Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): ``min(w, is_cap)``;
* ``mis`` (masked importance sampling; Liu et al. 2025, as verl's ``rollout_is: mask``): a token with
  ``w > is_cap`` or ``w < 1 / is_cap`` gets weight 0 (it keeps its place in the aggregation's denominator).

When both layouts agree to the bit, every weight is exactly 1 (``exp(0)``) and the loss is the uncorrected one.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

IsCorrection = Literal["none", "tis", "mis"]  # algo.is_correction
IS_CORRECTIONS: tuple[IsCorrection, ...] = get_args(IsCorrection)


def importance_weights(train_logprobs: torch.Tensor, gen_logprobs: torch.Tensor, mask: torch.Tensor, mode: IsCorrection,
                       cap: float) -> tuple[torch.Tensor, dict]:
    """``[T]`` weights ``w = exp(train - gen)`` on the masked tokens, truncated (``tis``) or masked (``mis``) at
    ``cap``; 0 off the mask. Statistics over the masked tokens: ``is_weight_mean`` and ``is_weight_max`` (before the
    correction), ``is_weight_min``, ``is_log_ratio_abs`` (mean ``|train - gen|``, the layouts' mismatch) and
    ``is_weight_corrected`` (the fraction truncated or masked)."""
    if mode not in IS_CORRECTIONS[1:]:
        raise ValueError(f"is_correction must be one of {IS_CORRECTIONS[1:]}, got {mode!r}")
    with torch.no_grad():
        log_w = (train_logprobs.detach().float() - gen_logprobs.detach().float()).masked_fill(~mask, 0.0)
        raw = torch.exp(log_w)
        if mode == "tis":
            changed = mask & (raw > cap)
            weights = torch.where(changed, torch.full_like(raw, cap), raw)
        else:
            changed = mask & ((raw > cap) | (raw < 1.0 / cap))
            weights = torch.where(changed, torch.zeros_like(raw), raw)
        m = mask.float()
        count = m.sum().clamp(min=1)
        stats = {
            "is_weight_mean": float((raw * m).sum() / count),
            "is_weight_max": float(raw[mask].max()) if bool(mask.any()) else 1.0,
            "is_weight_min": float(raw[mask].min()) if bool(mask.any()) else 1.0,
            "is_log_ratio_abs": float((log_w.abs() * m).sum() / count),
            "is_weight_corrected": float(changed.float().sum() / count),
        }
        return weights * m, stats
