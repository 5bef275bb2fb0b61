"""What asynchronous training (``plan.execution: async``) asks of an algorithm's loss: token ages and their weights.

In async mode a train step at policy version ``v`` (``CallContext.policy_version``, from the runtime)
consumes tokens that older versions generated; ``versions`` records, per token, the version that
produced it (-1 on prompt tokens). This module measures those ages against the staleness bound
``k = plan.staleness`` (raising ``StalenessError`` past it: the runtime's buffer enforces the bound,
this is the last check before a gradient) and gives custom losses the importance weights of the
decoupled objective (``losses.behaviour_weights``). docs/algorithms.md, "Asynchronous training".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import losses
from restage.algorithms._graphs import ACTOR_TRAIN, is_async
from restage.algorithms.base import CallContext
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import StalenessError


@dataclass(frozen=True)
class TrainVersion:
    """The policy version a train step starts from and how many versions older its tokens may be."""

    policy_version: int
    staleness: int


def train_version(cfg: ExperimentConfig, ctx: CallContext) -> TrainVersion | None:
    """The version the actor trains at in async mode (from ``ctx.policy_version``); None in sync mode."""
    if not is_async(cfg):
        return None
    if ctx.policy_version is None:
        raise ValueError(f"plan.execution is async but the runtime set no policy_version before {ACTOR_TRAIN}")
    return TrainVersion(int(ctx.policy_version), cfg.plan.staleness)


def answer_versions(prompt_mask: torch.Tensor, version: int) -> torch.Tensor:
    """The ``versions`` key of answers one policy version generated whole: ``version`` on answer tokens, -1 on prompts.

    (With partial rollouts the generator writes each token's own version instead.)"""
    return torch.where(prompt_mask.bool(), -1, version).to(torch.int64)


def version_gaps(versions: torch.Tensor, mask: torch.Tensor, at: TrainVersion) -> torch.Tensor:
    """``[n]`` version gaps (``policy_version - versions``) of the masked tokens; raises past the bound.

    A gap above ``staleness`` raises ``StalenessError``; a negative one (a token from a version not yet
    trained) is a bookkeeping bug and raises ``ValueError``.
    """
    gaps = at.policy_version - versions[mask].long()
    if gaps.numel() == 0:
        return gaps
    oldest, newest = int(gaps.max()), int(gaps.min())
    if oldest > at.staleness:
        stale = int((gaps > at.staleness).sum())
        raise StalenessError(
            f"{ACTOR_TRAIN} at policy version {at.policy_version} got {stale} answer tokens from version "
            f"{at.policy_version - oldest} ({oldest} versions old), past plan.staleness={at.staleness}; "
            f"raise plan.staleness to {oldest} to train on them")
    if newest < 0:
        raise ValueError(f"{ACTOR_TRAIN} at policy version {at.policy_version} got tokens of version "
                         f"{at.policy_version - newest}, which does not exist yet: the versions key is wrong")
    return gaps


def version_gap_stats(versions: torch.Tensor, mask: torch.Tensor, at: TrainVersion) -> dict[str, float]:
    """The version-gap histogram of the masked tokens (``version_gap_<g>``: fraction at gap g, for g in 0..k),
    ``version_gap_mean`` and ``version_gap_max``; checks the bound first (``version_gaps``)."""
    gaps = version_gaps(versions, mask, at)
    count = max(1, gaps.numel())
    histogram = torch.bincount(gaps, minlength=at.staleness + 1) if gaps.numel() else torch.zeros(at.staleness + 1)
    stats = {f"version_gap_{g}": float(histogram[g]) / count for g in range(at.staleness + 1)}
    stats["version_gap_mean"] = float(gaps.double().sum()) / count
    stats["version_gap_max"] = float(gaps.max()) if gaps.numel() else 0.0
    return stats


def correction(micro_batch: Batch, mask: torch.Tensor, cfg: ExperimentConfig, ctx: CallContext,
               weight_cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """For a custom loss: ``[T]`` per-token weights to multiply its terms by, and their statistics.

    Sync mode: all ones (the loss is unchanged to the bit) and no statistics. Async mode: the capped
    importance weights ``exp(prox_logprobs - logprobs)`` of ``losses.behaviour_weights`` (0 off ``mask``),
    after the staleness check, with the version-gap and weight statistics.
    """
    at = train_version(cfg, ctx)
    if at is None:
        return torch.ones_like(mask, dtype=torch.float32), {}
    stats = version_gap_stats(micro_batch["versions"], mask, at)
    weights, weight_stats = losses.behaviour_weights(micro_batch["prox_logprobs"].float(),
                                                     micro_batch["logprobs"].float(), mask, weight_cap)
    return weights, stats | weight_stats
