"""Tensor operations over packed sequences (``[T]`` tensors cut by ``cu_seqlens``).

Token alignment used everywhere: ``logprobs[t]`` is ``log p(token t | tokens < t)`` and
``entropy[t]`` the entropy of that same next-token distribution; both are 0 on the first token
of every sequence, which has no prediction. A critic's ``values[t]`` is its output at token
``t`` (it has seen tokens ``<= t``), so the value of the state *before* token ``t`` is
``values[t - 1]`` (see ``shift_right``).

``reduce`` arguments sum a tensor over all data-parallel shards (``all_reduce(SUM)``) so masked
statistics are global; ``None`` means this shard is the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Reduce = Callable[[torch.Tensor], torch.Tensor] | None


def seqlens_of(cu_seqlens: torch.Tensor) -> torch.Tensor:
    return (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def seq_index(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` index of the sequence each token belongs to."""
    lengths = seqlens_of(cu_seqlens)
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)


def seq_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool, true on the first token of each sequence."""
    starts = torch.zeros(int(cu_seqlens[-1]), dtype=torch.bool, device=cu_seqlens.device)
    starts[cu_seqlens[:-1].long()] = True
    return starts


def seq_sum(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[n]`` sum of a ``[T]`` tensor over each sequence."""
    n = cu_seqlens.numel() - 1
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add(0, seq_index(cu_seqlens), x)


def last_token(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[n]`` value of a ``[T]`` tensor at each sequence's last token (a reward model's score)."""
    return x[cu_seqlens[1:].long() - 1]


def last_masked(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` bool, true on the last token of each sequence where ``mask`` holds (none if a sequence has none)."""
    idx = torch.arange(mask.numel(), device=mask.device)
    pos = torch.where(mask, idx, torch.full_like(idx, -1))
    n = cu_seqlens.numel() - 1
    last = torch.full((n,), -1, dtype=torch.long, device=mask.device).scatter_reduce(
        0, seq_index(cu_seqlens), pos, reduce="amax")
    out = torch.zeros_like(mask, dtype=torch.bool)
    out[last[last >= 0]] = True
    return out


def broadcast_seq(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` copy of a per-sequence ``[n]`` value onto every token of its sequence."""
    return x[seq_index(cu_seqlens)]


def shift_right(x: torch.Tensor, cu_seqlens: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """``out[t] = x[t - 1]`` inside each sequence, ``fill`` on every first token."""
    out = torch.roll(x, 1, 0)
    return out.masked_fill(seq_starts(cu_seqlens), fill)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of ``x`` where ``mask``, count of ``mask``), both global under ``reduce``."""
    pair = torch.stack([(x * mask).sum().to(torch.float64), mask.sum().to(torch.float64)])
    if reduce is not None:
        pair = reduce(pair)
    return pair[0], pair[1]


def masked_mean(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce = None) -> torch.Tensor:
    """Mean of ``x`` where ``mask`` (0 when the mask is empty)."""
    total, count = masked_sum(x, mask, reduce)
    return (total / count.clamp(min=1)).to(x.dtype)


def masked_moments(x: torch.Tensor, mask: torch.Tensor, reduce: Reduce = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, population variance, count) of ``x`` where ``mask``; global under ``reduce``."""
    m = mask.to(torch.float64)
    x64 = x.to(torch.float64)
    sums = torch.stack([(x64 * m).sum(), (x64 * x64 * m).sum(), m.sum()])
    if reduce is not None:
        sums = reduce(sums)
    count = sums[2].clamp(min=1)
    mean = sums[0] / count
    var = (sums[1] / count - mean * mean).clamp(min=0)
    return mean, var, sums[2]


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, reduce: Reduce = None) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with masked (global) moments; 0 outside the mask."""
    mean, var, _ = masked_moments(x, mask, reduce)
    out = (x.to(torch.float64) - mean) * torch.rsqrt(var + eps)
    return (out * mask).to(x.dtype)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` log-probability of each token under the logits of the token before it (0 on first tokens).

    ``logits`` is ``[T, V]``, the model output at every packed token.
    """
    prev = torch.roll(logits, 1, 0)  # row t now holds the logits produced at t - 1
    lp = torch.log_softmax(prev.float(), dim=-1).gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)
    return lp.masked_fill(seq_starts(cu_seqlens), 0.0)


def token_entropy(logits: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[T]`` entropy of the distribution that predicts each token (0 on first tokens)."""
    prev = torch.roll(logits, 1, 0).float()
    logp = torch.log_softmax(prev, dim=-1)
    ent = -(logp.exp() * logp).sum(-1)
    return ent.masked_fill(seq_starts(cu_seqlens), 0.0)
