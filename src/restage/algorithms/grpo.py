"""GRPO: a group of samples per prompt, group-normalised advantages, a KL term; no critic.

Each prompt is answered ``group_size`` times; an answer's advantage is its reward minus the group
mean, over the group's (unbiased) std, on every answer token. The loss is the clipped surrogate
plus ``kl_coef`` times the k3 estimate of KL(policy || ref) per token. With ``kl_coef`` 0 (and no
reference EMA) the graph has no ``ref_inf`` MFC and the config needs no ``models.ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import _policy, base, estimators, losses, offpolicy, ops
from restage.algorithms._graphs import ACTOR_GEN, ACTOR_TRAIN, REF_INF, REWARD_INF, reward_source, sizes, with_proximal
from restage.config import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC


@dataclass(frozen=True)
class Params(_policy.KLPolicyParams):
    group_size: int = 4
    ppo_epochs: int = 1
    minibatches: int = 1
    kl_coef: float = 0.04
    kl_estimator: str = "k3"
    norm_std: bool = True  # divide by the group std (False: only subtract the group mean)
    adv_eps: float = 1e-6
    loss_agg: str = "seq_mean"


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    group = int(cfg.algo.get("group_size", 4))
    n, p, g, mb = s["prompts"] * group, s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    minibatches = int(cfg.algo.get("minibatches", 1))
    epochs = int(cfg.algo.get("ppo_epochs", 1))
    seq = ("seqs", "prompt_mask")
    gen_out = ("seqs", "prompt_mask", "logprobs") + (("rewards",) if reward_source(cfg) == "function" else ())
    out = [MFC(ACTOR_GEN, "generate", "actor", ("prompts",), gen_out, n, p, g, mb, options={"group_size": group})]
    if reward_source(cfg) == "model":
        out.append(MFC(REWARD_INF, "inference", "reward", seq, ("rewards",), n, p, g, mb))
    ref = _policy.config_uses_ref(Params, cfg)
    if ref:
        out.append(MFC(REF_INF, "inference", "ref", seq, ("ref_logprobs",), n, p, g, mb))
    train_in = seq + ("logprobs",) + (("ref_logprobs",) if ref else ()) + ("rewards",)
    out.append(MFC(ACTOR_TRAIN, "train_step", "actor", train_in, (), n, p, g, mb, minibatches, epochs,
                   options=_policy.train_options(cfg)))
    return with_proximal(cfg, out)


def validate(cfg: ExperimentConfig) -> Params:
    params = _policy.validate_kl_policy(Params, cfg)
    base.check_positive(params, "group_size", "ppo_epochs", "minibatches", "adv_eps")
    return params


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    return _policy.forward_outputs(Params, mfc_name, cfg)


def prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                  reduce: ops.Reduce = None) -> tuple[Batch, dict]:
    """Adds per-token ``advantages``; the result has groups of 1 (minibatches may then cut groups apart)."""
    p: Params = state.params
    if batch.group_size != p.group_size:
        raise ValueError(f"grpo: batch has groups of {batch.group_size}, algo.group_size is {p.group_size}")
    mask = base.answer_mask(batch)
    rewards = _policy.shaped_rewards(batch, p)
    seq_advantages = estimators.group_normalise(rewards, p.group_size, p.adv_eps, p.norm_std)
    advantages = ops.broadcast_seq(seq_advantages, batch.cu_seqlens) * mask
    all_seqs = torch.ones(batch.n_seqs, dtype=torch.bool)
    grouped = rewards.view(-1, p.group_size)
    # A group whose answers all score the same teaches nothing; its spread says how much signal there is.
    spread = grouped.std(-1) if p.group_size > 1 else torch.zeros(grouped.shape[0])
    stats = {
        "reward": float(ops.masked_mean(batch["rewards"].float(), all_seqs, reduce)),
        "group_reward_std": float(ops.masked_mean(spread, torch.ones_like(spread, dtype=torch.bool), reduce)),
        "answer_tokens": float(ops.masked_sum(mask.float(), mask, reduce)[1]),
    }
    ids = tuple(i for i in batch.ids for _ in range(p.group_size)) if batch.ids else ()
    return batch.with_keys(tokens={"advantages": advantages.float()}, group_size=1, ids=ids), stats


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig,
         state: base.AlgoState) -> tuple[torch.Tensor, dict]:
    p: Params = state.params
    if mfc_name != ACTOR_TRAIN:
        raise ValueError(f"grpo has no train MFC {mfc_name!r}")
    at = offpolicy.train_version(cfg, state)
    if p.kl_coef == 0:  # no KL term: the reference's log-probs are not read (and not computed, see mfcs)
        return _policy.actor_loss(micro_batch, outputs, p, at=at)
    kl = losses.kl_estimate(outputs["logprobs"].float(), micro_batch["ref_logprobs"].float(), p.kl_estimator)
    return _policy.actor_loss(micro_batch, outputs, p, kl, p.kl_coef, at=at)
