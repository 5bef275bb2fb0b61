"""Small registries of the policy-gradient algorithms' parts: advantage estimators, policy losses, loss aggregations.

A variant is one registered function (verl's ``register_adv_est`` / ``register_policy_loss`` pattern):

    @register_advantage("rloo")
    def rloo(rewards: torch.Tensor, ctx: AdvantageInputs) -> torch.Tensor: ...

and a config picks it by name (``algo.advantage: rloo``). The names a config may give are the registry's keys,
written once here: ``validate`` checks ``algo.*`` against ``names(...)``. The built-in parts live in
``algorithms/variants.py`` (advantages, policy losses; imported by the algorithms that look them up) and
``algorithms/aggregations.py`` (imported by ``losses``).
docs/algorithms.md lists each built-in part with its source paper and config keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from restage.algorithms.packed_ops import Reduce


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read besides the sequence rewards: the group layout (``group_size``
    consecutive sequences answer one prompt), the answer-token ``mask`` (a zero excludes a token everywhere),
    the per-token KL to the reference (zeros without one) and its coefficient when the KL goes into the reward
    (``algo.kl_in_reward``; else 0), ``eps`` of the std divisions, and ``reduce`` (a sum over the dp ranks, for
    estimators that whiten over the whole batch; None on one rank)."""

    group_size: int
    mask: torch.Tensor
    cu_seqlens: torch.Tensor
    token_kl: torch.Tensor
    kl_coef: float
    eps: float
    reduce: Reduce = None


@dataclass(frozen=True)
class LossNorm:
    """What a loss aggregation divides by in a train step (``execute.loss_norm``): the optimizer step's answer
    tokens, sequences and sequences holding answer tokens, summed over its micro-batches and dp ranks, each divided
    by the number of loss parts whose gradients DeepSpeed averages (micro-batches x dp ranks). A part's loss
    ``sum / (N / parts)`` then averages to the step's ``sum / N``: one gradient whatever the dp degree and the
    micro-batch count (TRL's ``dapo`` normalises by the whole batch's tokens so). None (outside a train step: tests,
    tools): the micro-batch's own counts."""

    tokens: float
    seqs: float
    answered_seqs: float


# The key of ``outputs`` (the loss function's model outputs) under which a train step gives its ``LossNorm``.
LOSS_NORM = "loss_norm"

# advantage(rewards [n_seqs], inputs) -> per-token advantages [T], 0 off the mask
AdvantageFn = Callable[[torch.Tensor, AdvantageInputs], torch.Tensor]
# policy_loss(logprobs, anchor_logprobs, advantages, mask, cu_seqlens, clip_low, clip_high) -> (per-token loss, stats)
PolicyLossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float],
                        tuple[torch.Tensor, dict]]
# aggregation(per_token, mask, cu_seqlens, norm_tokens, norm) -> scalar; norm_tokens: the generation's
# max_new_tokens; norm: the train step's LossNorm (None: the micro-batch's own counts)
AggregationFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, "LossNorm | None"], torch.Tensor]

ADVANTAGES: dict[str, AdvantageFn] = {}
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
AGGREGATIONS: dict[str, AggregationFn] = {}

F = TypeVar("F", bound=Callable[..., Any])


def _register(table: dict, kind: str, name: str) -> Callable[[F], F]:
    def add(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is registered already")
        table[name] = fn
        return fn
    return add


def register_advantage(name: str) -> Callable[[F], F]:
    """Decorator: make ``fn(rewards, AdvantageInputs) -> [T] advantages`` the estimator ``algo.advantage: name``."""
    return _register(ADVANTAGES, "advantage", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: make ``fn(logprobs, anchor, advantages, mask, cu_seqlens, clip_low, clip_high) -> (per-token loss,
    stats)`` the loss ``algo.policy_loss: name`` (aggregated afterwards by ``algo.loss_agg``)."""
    return _register(POLICY_LOSSES, "policy loss", name)


def register_aggregation(name: str) -> Callable[[F], F]:
    """Decorator: make ``fn(per_token, mask, cu_seqlens, norm_tokens) -> scalar`` the aggregation ``algo.loss_agg``."""
    return _register(AGGREGATIONS, "aggregation", name)


def names(table: dict) -> tuple[str, ...]:
    """The registered names, the allowed values of the config key that picks from ``table``."""
    return tuple(table)

