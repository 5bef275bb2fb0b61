"""Estimators and small stateful helpers of the RL algorithms.

GAE over packed sequences, group-normalised advantages, reward shaping, the running value
normaliser and the KL controllers (both with ``state_dict``/``load_state_dict`` for checkpoints),
the minibatch splitter and the reference-model EMA rule.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import torch

from restage.algorithms import packed_ops
from restage.algorithms.packed_ops import Reduce
from restage.data.batch import Batch


def _padded_actions(mask: torch.Tensor, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, A]`` packed index of each sequence's action tokens (in order, left-aligned) and its validity mask."""
    seq = packed_ops.seq_index(cu_seqlens)[mask]
    positions = torch.nonzero(mask).squeeze(-1)
    n = cu_seqlens.numel() - 1
    counts = torch.zeros(n, dtype=torch.long, device=mask.device).index_add(0, seq, torch.ones_like(seq))
    width = int(counts.max()) if n and counts.numel() else 0
    offsets = torch.cumsum(counts, 0) - counts
    column = torch.arange(positions.numel(), device=mask.device) - offsets[seq]
    index = torch.zeros(n, width, dtype=torch.long, device=mask.device)
    valid = torch.zeros(n, width, dtype=torch.bool, device=mask.device)
    index[seq, column] = positions
    valid[seq, column] = True
    return index, valid


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the action tokens (``mask``) of packed sequences.

    ``values[t]`` is V of the state before action token ``t``; the state after a sequence's last
    action is terminal (value 0). Tokens outside ``mask`` are skipped (they are not steps).
    ``delta_t = r_t + gamma V_next - V_t``, ``A_t = delta_t + gamma lam A_next``, returns ``A + V``.
    Returns (advantages, returns), ``[T]``, 0 outside the mask.
    """
    index, valid = _padded_actions(mask, cu_seqlens)
    r = token_rewards.float()[index] * valid
    v = values.float()[index] * valid
    adv = torch.zeros_like(r)
    next_adv = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_value = torch.zeros_like(next_adv)
    for col in range(r.shape[1] - 1, -1, -1):
        live = valid[:, col]
        delta = r[:, col] + gamma * next_value - v[:, col]
        current = delta + gamma * lam * next_adv
        adv[:, col] = torch.where(live, current, torch.zeros_like(current))
        # A column past a sequence's end leaves next_* at 0, which makes its last action terminal.
        next_adv = torch.where(live, current, torch.zeros_like(current))
        next_value = torch.where(live, v[:, col], torch.zeros_like(current))
    advantages = torch.zeros_like(token_rewards, dtype=torch.float32)
    advantages[index[valid]] = adv[valid]
    returns = (advantages + values.float()) * mask
    return advantages, returns


def group_normalise(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, use_std: bool = True) -> torch.Tensor:
    """GRPO advantages ``(r - mean_group) / (std_group + eps)`` (unbiased std) for consecutive groups of sequences.

    ``use_std=False`` only subtracts the group mean. A group of one gets advantage 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(-1, keepdim=True)
    if use_std and group_size > 1:
        centred = centred / (grouped.std(-1, keepdim=True) + eps)
    return centred.view(-1)


def shape_rewards(rewards: torch.Tensor, scale: float = 1.0, bias: float = 0.0, clip: float = 0.0) -> torch.Tensor:
    """``(r - bias) * scale``, clipped to ``[-clip, clip]`` when ``clip > 0``."""
    out = (rewards.float() - bias) * scale
    return out.clamp(-clip, clip) if clip > 0 else out


def kl_shaped_token_rewards(seq_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor,
                            kl_coef: float) -> torch.Tensor:
    """Per-token rewards ``-kl_coef * kl_t`` on action tokens, plus the sequence reward on each sequence's last action."""
    out = -kl_coef * kl.float() * mask
    last = packed_ops.last_masked(mask, cu_seqlens)
    out[last] += seq_rewards.float()[packed_ops.seq_index(cu_seqlens)[last]]
    return out


def returns_to_go(token_rewards: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``sum_{t' >= t} r_t'`` over the action tokens of each sequence (undiscounted), 0 outside the mask."""
    advantages, _ = gae(token_rewards, torch.zeros_like(token_rewards, dtype=torch.float32), mask, cu_seqlens, 1.0, 1.0)
    return advantages


class ValueNormaliser:
    """Running mean and variance of the returns (exact, merged batch by batch); the critic learns normalised returns."""

    def __init__(self, eps: float = 1e-5):
        self.eps = eps
        self.mean, self.var, self.count = 0.0, 1.0, 0.0

    def update(self, x: torch.Tensor, mask: torch.Tensor, reduce: Reduce = None) -> None:
        mean, var, count = (float(v) for v in packed_ops.masked_moments(x, mask, reduce))
        if count == 0:
            return
        if self.count == 0:
            self.mean, self.var, self.count = mean, var, count
            return
        total = self.count + count
        delta = mean - self.mean
        m2 = self.var * self.count + var * count + delta * delta * self.count * count / total
        self.mean, self.var, self.count = self.mean + delta * count / total, m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(self.var + self.eps)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalise(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, value: float):
        self.value = value

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (2019): move the coefficient so the sequence KL tracks ``target``.

    ``error = clip(kl / target - 1, -0.2, 0.2)``; ``value *= 1 + error * n_steps / horizon``, where
    ``n_steps`` is the number of sequences the KL was measured on.
    """

    def __init__(self, value: float, target: float, horizon: float):
        self.value, self.target, self.horizon = value, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


def minibatches(batch: Batch, n_minibatches: int, epochs: int = 1, seed: int = 0) -> Iterator[tuple[int, int, Batch]]:
    """``(epoch, index, minibatch)``: each epoch shuffles the samples (seeded) and cuts them into ``n`` parts.

    Every sample lands in exactly one minibatch per epoch; parts differ in size by at most one sample.
    """
    n = max(1, min(n_minibatches, batch.n_samples))
    for epoch in range(epochs):
        order = list(range(batch.n_samples))
        random.Random(seed * 7_919 + epoch).shuffle(order)
        bounds = [round(i * len(order) / n) for i in range(n + 1)]
        for index in range(n):
            yield epoch, index, batch.select(order[bounds[index]:bounds[index + 1]])


def ema_master(ref: torch.Tensor) -> torch.Tensor | None:
    """The fp32 master copy (in host memory) that ``ema_mix_`` mixes into for a ``ref`` held in a narrower dtype,
    or None for an fp32 ``ref``, which is its own master."""
    if ref.dtype == torch.float32:
        return None
    return ref.detach().to("cpu", torch.float32, copy=True)


@torch.no_grad()
def ema_mix_(ref: torch.Tensor, actor: torch.Tensor, eta: float, master: torch.Tensor | None = None) -> torch.Tensor:
    """Reference EMA, in place: ``ref <- (1 - eta) ref + eta actor`` (eta = 1 copies the actor).

    With ``master`` (``ema_master``: ``ref`` in fp32) the mix runs on the master and ``ref`` becomes it rounded to
    its dtype: in bf16 a step under half an ulp of ``ref`` (with eta = 0.01, any step of a weight of 1 whose actor
    weight is under 0.39 away) would round away every time, and the reference would never move.
    """
    if master is None:
        return ref.lerp_(actor.to(ref.dtype), eta)
    master.lerp_(actor.to(master.device, torch.float32), eta)
    return ref.copy_(master)
