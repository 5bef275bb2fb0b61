"""The built-in loss aggregations (``registry.AGGREGATIONS``, picked by ``algo.loss_agg``): how per-token terms
become one scalar. Apart from ``variants.py`` because ``losses.aggregate`` needs them and ``variants`` needs
``losses``; docs/algorithms.md has each one's source.
"""

from __future__ import annotations

import torch

from restage.algorithms import packed_ops
from restage.algorithms.registry import LossNorm, register_aggregation


@register_aggregation("token_mean")
def token_mean(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, norm_tokens: int,
               norm: LossNorm | None = None) -> torch.Tensor:
    """Mean over the optimizer step's answer tokens (DAPO's token-level loss; TRL's ``dapo``, and its ``bnpo`` on
    one process)."""
    m = mask.to(per_token.dtype)
    denominator = m.sum() if norm is None else torch.tensor(norm.tokens, dtype=per_token.dtype)
    return (per_token * m).sum() / denominator.clamp(min=1)


@register_aggregation("seq_mean")
def seq_mean(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor, norm_tokens: int,
             norm: LossNorm | None = None) -> torch.Tensor:
    """Mean over the optimizer step's sequences (with answer tokens) of each one's token mean (GRPO's; TRL's
    ``grpo``)."""
    m = mask.to(per_token.dtype)
    counts = packed_ops.seq_sum(m, cu_seqlens)
    per_seq = packed_ops.seq_sum(per_token * m, cu_seqlens) / counts.clamp(min=1)
    has_tokens = counts > 0
    denominator = has_tokens.sum() if norm is None else torch.tensor(norm.answered_seqs)
    return per_seq[has_tokens].sum() / denominator.to(per_token.dtype).clamp(min=1)


@register_aggregation("seq_mean_token_sum")
def seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
                       norm_tokens: int, norm: LossNorm | None = None) -> torch.Tensor:
    """Mean over the optimizer step's sequences of each one's token sum (verl's ``seq-mean-token-sum``)."""
    m = mask.to(per_token.dtype)
    seqs = cu_seqlens.numel() - 1 if norm is None else norm.seqs
    return (per_token * m).sum() / max(seqs, 1)


@register_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(per_token: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
                            norm_tokens: int, norm: LossNorm | None = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): the token sum over ``n_seqs * max_new_tokens`` (the optimizer step's sequences),
    a constant, so no answer's length scales its tokens' weight (TRL's ``dr_grpo``)."""
    if norm_tokens <= 0:
        raise ValueError("seq_mean_token_sum_norm needs the generation's max_new_tokens (norm_tokens > 0)")
    m = mask.to(per_token.dtype)
    seqs = cu_seqlens.numel() - 1 if norm is None else norm.seqs
    return (per_token * m).sum() / (seqs * norm_tokens)
