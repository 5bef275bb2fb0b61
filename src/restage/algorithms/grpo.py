"""GRPO: a group of samples per prompt, group-normalised advantages, a KL term; no critic.

Each prompt is answered ``group_size`` times; an answer's advantage is its reward minus the group
mean, over the group's (unbiased) std, on every answer token. The loss is the clipped surrogate
plus ``kl_coef`` times the k3 estimate of KL(policy || ref) per token. With ``kl_coef`` 0 (and no
reference EMA) the graph has no ``ref_inf`` MFC and the config needs no ``models.ref``.

The variants of 2025 are this module with other registered parts (``registry.py``, docs/algorithms.md):
``algo.advantage`` (grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline), ``algo.policy_loss`` (ppo, gspo),
``algo.loss_agg``, DAPO's decoupled clip (``clip_eps_low``/``clip_eps_high``), overlong penalty
(``overlong_buffer``/``overlong_penalty``) and dynamic sampling (``dynamic_sampling``/``max_sampling_rounds``;
``runtime/step/dynamic_sampling.py`` refills the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import _policy, base, losses, offpolicy, packed_ops, registry
from restage.algorithms._graphs import ACTOR_GEN, ACTOR_TRAIN, REF_INF, REWARD_INF, reward_source, sizes, with_proximal
from restage.algorithms.losses import KlEstimator
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFC, MFCKind, MFCOptions


@dataclass(frozen=True)
class Params(_policy.KLPolicyParams):
    group_size: int = 4
    ppo_epochs: int = 1
    minibatches: int = 1
    kl_coef: float = 0.04
    kl_estimator: KlEstimator = "k3"
    norm_std: bool = True  # advantage grpo: divide by the group std (False: only subtract the group mean)
    adv_eps: float = 1e-6
    loss_agg: str = "seq_mean"
    advantage: str = "grpo"  # a registered advantage estimator (registry.ADVANTAGES)
    kl_in_reward: bool = False  # the KL (kl_coef, kl_estimator) goes into the per-token reward, not the loss
    overlong_buffer: int = 0  # > 0: DAPO's soft overlong penalty over the last this-many tokens of max_new_tokens
    overlong_penalty: float = 1.0  # ... falling linearly from 0 to -overlong_penalty at max_new_tokens
    dynamic_sampling: bool = False  # DAPO: groups whose rewards are all equal are replaced by fresh prompts' groups
    max_sampling_rounds: int = 3  # ... in at most this many extra generation rounds per step


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    group = int(cfg.algo.get("group_size", 4))
    n, p, g, mb = s["prompts"] * group, s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    minibatches = int(cfg.algo.get("minibatches", 1))
    epochs = int(cfg.algo.get("ppo_epochs", 1))
    seq = ("seqs", "prompt_mask")
    gen_out = ("seqs", "prompt_mask", "logprobs") + (("rewards",) if reward_source(cfg) == "function" else ())
    # runtime/step/dynamic_sampling.py reads the rounds
    rounds = int(cfg.algo.get("max_sampling_rounds", 3)) if bool(cfg.algo.get("dynamic_sampling", False)) else None
    gen_options = MFCOptions(group_size=group, dynamic_sampling_rounds=rounds)
    out = [MFC(ACTOR_GEN, MFCKind.GENERATE, "actor", ("prompts",), gen_out, n, p, g, mb, options=gen_options)]
    if reward_source(cfg) == "model":
        out.append(MFC(REWARD_INF, MFCKind.INFERENCE, "reward", seq, ("rewards",), n, p, g, mb))
    ref = _policy.config_uses_ref(Params, cfg)
    if ref:
        out.append(MFC(REF_INF, MFCKind.INFERENCE, "ref", seq, ("ref_logprobs",), n, p, g, mb))
    train_in = seq + ("logprobs",) + (("ref_logprobs",) if ref else ()) + ("rewards",)
    out.append(MFC(ACTOR_TRAIN, MFCKind.TRAIN_STEP, "actor", train_in, (), n, p, g, mb, minibatches, epochs,
                   options=_policy.train_options(cfg)))
    return with_proximal(cfg, out)


def validate(cfg: ExperimentConfig) -> Params:
    params = _policy.validate_kl_policy(Params, cfg)
    base.check_positive(params, "group_size", "ppo_epochs", "minibatches", "adv_eps")
    base.check_choice("advantage", params.advantage, registry.names(registry.ADVANTAGES))
    base.check_positive(params, "overlong_buffer", "overlong_penalty", "max_sampling_rounds", allow_zero=True)
    if params.overlong_buffer >= cfg.generation.max_new_tokens:
        raise ConfigError(f"algo.overlong_buffer: {params.overlong_buffer} must be below generation.max_new_tokens "
                          f"({cfg.generation.max_new_tokens})")
    if params.dynamic_sampling:
        if not cfg.reward_fn:
            raise ConfigError("algo.dynamic_sampling needs a rule-based reward (reward_fn): the groups are filtered "
                              "on their rewards where they are generated")
        if params.group_size < 2:
            raise ConfigError("algo.dynamic_sampling needs algo.group_size >= 2 (a group of one never has a spread)")
        if cfg.plan.partial_rollouts:
            raise ConfigError("algo.dynamic_sampling does not run with plan.partial_rollouts (a group begun at one "
                              "step is scored only at the next, after the batch was filled); set one of them false")
        if params.max_sampling_rounds > 100:
            raise ConfigError(f"algo.max_sampling_rounds: {params.max_sampling_rounds} must be <= 100")
    return params


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return _policy.forward_outputs(Params, mfc_name, cfg)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to ``max_new_tokens - buffer`` answer tokens,
    then falling linearly to ``-penalty`` at ``max_new_tokens`` (and below it past); 0 everywhere with ``buffer`` 0."""
    if buffer <= 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    over = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * torch.clamp(over / buffer, max=1.0)


def prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                  reduce: packed_ops.Reduce = None) -> tuple[Batch, dict]:
    """Adds per-token ``advantages`` (the registered ``algo.advantage``); the result has groups of 1
    (minibatches may then cut groups apart)."""
    p: Params = state.params
    if batch.group_size != p.group_size:
        raise ValueError(f"grpo: batch has groups of {batch.group_size}, algo.group_size is {p.group_size}")
    mask = base.answer_mask(batch)
    rewards = _policy.shaped_rewards(batch, p)
    lengths = packed_ops.seq_sum(mask.float(), batch.cu_seqlens)
    penalty = overlong_penalty(lengths, cfg.generation.max_new_tokens, p.overlong_buffer, p.overlong_penalty)
    rewards = rewards + penalty
    estimator = "dr_grpo" if p.advantage == "grpo" and not p.norm_std else p.advantage
    in_reward = p.kl_in_reward and _policy.uses_ref(p)
    token_kl = _policy.ref_kl(batch, p, mask) if in_reward else torch.zeros(batch.n_tokens)
    inputs = registry.AdvantageInputs(p.group_size, mask, batch.cu_seqlens, token_kl, p.kl_coef if in_reward else 0.0,
                                      p.adv_eps, reduce)
    advantages = registry.ADVANTAGES[estimator](rewards, inputs) * mask
    all_seqs = torch.ones(batch.n_seqs, dtype=torch.bool)
    grouped = rewards.view(-1, p.group_size)
    # A group whose answers all score the same teaches nothing; its spread says how much signal there is.
    spread = grouped.std(-1) if p.group_size > 1 else torch.zeros(grouped.shape[0])
    raw = batch["rewards"].float().view(-1, p.group_size)
    informative = raw.max(-1).values > raw.min(-1).values
    stats = {
        "reward": float(packed_ops.masked_mean(batch["rewards"].float(), all_seqs, reduce)),
        "group_reward_std": float(packed_ops.masked_mean(spread, torch.ones_like(spread, dtype=torch.bool), reduce)),
        "answer_tokens": float(packed_ops.masked_sum(mask.float(), mask, reduce)[1]),
        "sequences": float(packed_ops.masked_sum(torch.ones(batch.n_seqs), all_seqs, reduce)[1]),  # the whole batch's
        # the share of groups whose (unshaped) rewards differ: DAPO's dynamic sampling raises it to 1
        "informative_groups": float(packed_ops.masked_mean(informative.float(), torch.ones_like(informative), reduce)),
    }
    if p.overlong_buffer > 0:
        stats["overlong_penalty"] = float(packed_ops.masked_mean(penalty, all_seqs, reduce))
    ids = tuple(i for i in batch.ids for _ in range(p.group_size)) if batch.ids else ()
    return batch.with_keys(tokens={"advantages": advantages.float()}, group_size=1, ids=ids), stats


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    p: Params = state.params
    if mfc_name != ACTOR_TRAIN:
        raise ValueError(f"grpo has no train MFC {mfc_name!r}")
    at = offpolicy.train_version(cfg, ctx)
    norm = cfg.generation.max_new_tokens
    if p.kl_coef == 0 or p.kl_in_reward:  # no KL term: the reference's log-probs are not read here
        return _policy.actor_loss(micro_batch, outputs, p, at=at, norm_tokens=norm)
    kl = losses.kl_estimate(outputs["logprobs"].float(), micro_batch["ref_logprobs"].float(), p.kl_estimator)
    return _policy.actor_loss(micro_batch, outputs, p, kl, p.kl_coef, at=at, norm_tokens=norm)
