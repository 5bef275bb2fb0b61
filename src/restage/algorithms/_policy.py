"""What the policy-gradient algorithms (PPO, GRPO, ReMax) share: hyper-parameters, reward shaping, the actor loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from restage.algorithms import (
    base,
    estimators,
    is_correction,
    losses,
    offpolicy,
    registry,
    variants,  # noqa: F401  (fills the registries with the built-in parts)
)
from restage.algorithms._graphs import ACTOR_TRAIN
from restage.algorithms.interface import build_graph
from restage.algorithms.is_correction import IsCorrection
from restage.algorithms.losses import KlEstimator
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFCOptions, RefEMA


@dataclass(frozen=True)
class PolicyParams:
    clip_eps: float = 0.2  # PPO ratio clip
    entropy_coef: float = 0.0  # > 0 adds an entropy bonus (the actor forward then also returns entropy)
    early_stop_ratio: float = 0.0  # > 0: stop this batch's updates once mean max(r, 1/r) over a micro-batch exceeds it
    early_stop_kl: float = 0.0  # > 0: stop this batch's updates once approx KL(old || new) exceeds it
    ref_ema_eta: float = 0.0  # > 0: after each actor update, ref <- (1 - eta) ref + eta actor
    reward_scale: float = 1.0  # rewards become (r - reward_bias) * reward_scale ...
    reward_bias: float = 0.0
    reward_clip: float = 0.0  # ... clipped to [-reward_clip, reward_clip] when > 0
    loss_agg: str = "token_mean"  # a registered aggregation (registry.AGGREGATIONS): token_mean, seq_mean, ...
    policy_loss: str = "ppo"  # a registered policy loss (registry.POLICY_LOSSES): ppo (per-token ratio), gspo
    clip_eps_low: float = 0.0  # > 0: the ratio's lower clip 1 - clip_eps_low (DAPO's decoupled clip); 0: clip_eps
    clip_eps_high: float = 0.0  # > 0: the ratio's upper clip 1 + clip_eps_high; 0: clip_eps
    # Importance-sampling correction between the generation's and the training layout's log-probs (is_correction.py)
    is_correction: IsCorrection = "none"  # none, tis (truncate weights at is_cap) or mis (drop tokens outside [1/cap, cap])
    is_cap: float = 2.0
    # plan.execution async: drop tokens whose importance weight exp(prox - behaviour) exceeds this (0: keep all)
    behav_imp_weight_cap: float = 5.0


@dataclass(frozen=True)
class KLPolicyParams(PolicyParams):
    """The policy params of an algorithm with a KL penalty against the reference (PPO, GRPO, ReMax)."""

    kl_coef: float = 0.05  # weight of the KL penalty (PPO: its initial value)
    kl_estimator: KlEstimator = "k1"


P = TypeVar("P", bound="KLPolicyParams")


def validate_policy(params: PolicyParams) -> None:
    base.check_positive(params, "clip_eps", "reward_scale")
    base.check_positive(params, "entropy_coef", "early_stop_ratio", "early_stop_kl", "reward_clip", allow_zero=True)
    base.check_choice("loss_agg", params.loss_agg, registry.names(registry.AGGREGATIONS))
    base.check_choice("policy_loss", params.policy_loss, registry.names(registry.POLICY_LOSSES))
    base.check_positive(params, "clip_eps_low", "clip_eps_high", allow_zero=True)
    if params.clip_eps_low >= 1.0 or (params.clip_eps_low == 0 and params.clip_eps >= 1.0):
        raise ConfigError(f"algo.clip_eps_low: the ratio's lower clip 1 - {params.clip_eps_low or params.clip_eps} "
                          "must stay above 0: set it below 1")
    if not params.is_cap > 1.0:
        raise ConfigError(f"algo.is_cap: {params.is_cap} must be > 1")
    if not 0.0 <= params.ref_ema_eta <= 1.0:
        raise ConfigError(f"algo.ref_ema_eta: {params.ref_ema_eta} must be in [0, 1]")
    if 0 < params.early_stop_ratio <= 1.0:
        raise ConfigError(f"algo.early_stop_ratio: {params.early_stop_ratio} must be > 1 (or 0 to turn it off)")
    if params.behav_imp_weight_cap != 0 and not params.behav_imp_weight_cap > 1.0:
        raise ConfigError(f"algo.behav_imp_weight_cap: {params.behav_imp_weight_cap} must be > 1 (or 0 to keep every "
                          "token)")


def validate_kl_policy(params_class: type[P], cfg: ExperimentConfig) -> P:
    """Parse ``algo:`` into ``params_class`` and check what every KL-penalised policy algorithm shares
    (the policy params, ``kl_coef`` >= 0, a known ``kl_estimator``, a reward source)."""
    params = base.parse_params(params_class, cfg)
    validate_policy(params)
    base.check_positive(params, "kl_coef", allow_zero=True)
    base.check_reward_source(cfg)
    return params


def uses_ref(params: KLPolicyParams) -> bool:
    """Whether the algorithm reads the reference model: a KL term (``kl_coef`` > 0) or a reference EMA to mix into.

    With neither, its graph has no ``ref_inf`` MFC and the config needs no ``models.ref`` (TRL's GRPOTrainer
    likewise loads no reference model at ``beta == 0``; docs/algorithms.md)."""
    return params.kl_coef > 0 or params.ref_ema_eta > 0


def config_uses_ref(params_class: type[KLPolicyParams], cfg: ExperimentConfig) -> bool:
    """``uses_ref`` of the config's ``algo:`` (``mfcs`` builds the graph from it before ``validate`` runs)."""
    return uses_ref(base.parse_params(params_class, cfg))


def ref_kl(batch: Batch, params: KLPolicyParams, mask: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || ref) estimate on answer tokens; zeros when the algorithm runs without a reference."""
    if not uses_ref(params):
        return torch.zeros(batch.n_tokens)
    return losses.kl_estimate(batch["logprobs"].float(), batch["ref_logprobs"].float(), params.kl_estimator) * mask


def forward_outputs(params_class: type[PolicyParams], mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    """The actor's train step asks for what the policy loss needs; other MFCs for the default outputs of their keys."""
    if mfc_name == ACTOR_TRAIN:
        return actor_forward_outputs(base.parse_params(params_class, cfg))
    return base.default_forward_outputs(build_graph(cfg), mfc_name)


def train_options(cfg: ExperimentConfig) -> MFCOptions:
    """MFC options of the actor's train step: the reference EMA weight and the model it updates, when on.

    The runtime (``schedule.program``'s ``ema`` op) applies it after each train step.
    """
    eta = float(cfg.algo.get("ref_ema_eta", 0.0))
    return MFCOptions(ref_ema=RefEMA(eta, "ref") if eta > 0 else None)


def actor_forward_outputs(params: PolicyParams) -> tuple[str, ...]:
    return ("logprobs", "entropy") if params.entropy_coef > 0 else ("logprobs",)


def shaped_rewards(batch: Batch, params: PolicyParams, key: str = "rewards") -> torch.Tensor:
    return estimators.shape_rewards(batch[key], params.reward_scale, params.reward_bias, params.reward_clip)


def clip_range(params: PolicyParams) -> tuple[float, float]:
    """The ratio's clip range ``(low, high)``: ``1 - low <= r <= 1 + high`` (each 0 in the config: ``clip_eps``)."""
    return params.clip_eps_low or params.clip_eps, params.clip_eps_high or params.clip_eps


def actor_loss(micro_batch: Batch, outputs: dict, params: PolicyParams,
               kl_per_token: torch.Tensor | None = None, kl_coef: float = 0.0,
               at: offpolicy.TrainVersion | None = None, norm_tokens: int = 0) -> tuple[torch.Tensor, dict]:
    """The registered policy loss (``algo.policy_loss``) on ``advantages`` against the generation's ``logprobs``,
    aggregated by ``algo.loss_agg`` (``norm_tokens``: the generation's ``max_new_tokens``), minus the entropy bonus,
    plus ``kl_coef`` times a per-token KL term (GRPO). A tripped early stop zeroes the loss and sets ``early_stop``
    to 1: the runtime skips this optimizer step and the rest of the batch.

    Async mode (``at``: ``offpolicy.train_version``): the decoupled surrogate instead, clipped against
    ``prox_logprobs`` and weighted by the capped importance weights against ``logprobs`` (the behaviour
    policy's), after checking every token's age; the version-gap and weight statistics join the stats.
    Sync mode with ``algo.is_correction``: clipped against ``prox_logprobs`` (the training layout's log-probs of
    the generating weights) and weighted by ``is_correction.importance_weights`` against ``logprobs`` (in async
    mode too, then in place of ``behav_imp_weight_cap``'s dropping)."""
    mask = base.answer_mask(micro_batch)
    cu = micro_batch.cu_seqlens
    new_logprobs = outputs["logprobs"].float()
    surrogate = registry.POLICY_LOSSES[params.policy_loss]
    low, high = clip_range(params)
    gen_logprobs = micro_batch["logprobs"].float()
    weights = None
    if at is None and params.is_correction == "none":
        per_token, stats = surrogate(new_logprobs, gen_logprobs, micro_batch["advantages"], mask, cu, low, high)
    else:
        prox = micro_batch["prox_logprobs"].float()
        per_token, stats = surrogate(new_logprobs, prox, micro_batch["advantages"], mask, cu, low, high)
        if at is not None:
            stats |= offpolicy.version_gap_stats(micro_batch["versions"], mask, at)
        if at is not None and params.is_correction == "none":
            weights, weight_stats = losses.behaviour_weights(prox, gen_logprobs, mask, params.behav_imp_weight_cap)
        else:  # sync, or async with is_correction: truncated or masked at is_cap instead of dropped at the cap
            weights, weight_stats = is_correction.importance_weights(prox, gen_logprobs, mask, params.is_correction,
                                                                     params.is_cap)
        stats |= weight_stats
    # The loss divides by the train step's counts (``registry.LossNorm``, from the runtime; None: this
    # micro-batch's), so its gradient is the same in every layout. Its statistics are this micro-batch's own means,
    # which the runtime averages over micro-batches and the master over dp ranks by their samples.
    norm = outputs.get(registry.LOSS_NORM)

    def term(per_token_term: torch.Tensor, name: str) -> torch.Tensor:
        value = losses.aggregate(per_token_term, mask, cu, params.loss_agg, norm_tokens, norm)
        local = value if norm is None else losses.aggregate(per_token_term.detach(), mask, cu, params.loss_agg,
                                                            norm_tokens)
        stats[name] = float(local.detach())
        return value

    value = term(per_token if weights is None else weights * per_token, "policy_loss")
    reported = stats["policy_loss"]
    if params.entropy_coef > 0:
        value = value - params.entropy_coef * term(outputs["entropy"].float(), "entropy")
        reported -= params.entropy_coef * stats["entropy"]
    if kl_per_token is not None:
        value = value + kl_coef * term(kl_per_token, "kl")
        reported += kl_coef * stats["kl"]
    stop = (params.early_stop_ratio > 0 and stats["ratio_dev"] > params.early_stop_ratio) or (
        params.early_stop_kl > 0 and stats["approx_kl"] > params.early_stop_kl)
    stats["early_stop"] = float(stop)
    if stop:
        value = value * 0.0  # keeps the graph (every rank still runs backward) but moves nothing
        reported = 0.0
    stats["loss"] = reported
    return value, stats
