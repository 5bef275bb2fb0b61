"""PPO with a critic, a reference model and a reward model (or a rule-based reward).

With ``kl_coef`` 0 (and no reference EMA) there is no reference model: no ``ref_inf`` MFC, no ``kl`` stat.

Per iteration: sample answers; score them; the reference and critic score every token; then
``prepare_train`` folds a per-token KL penalty into the reward, runs GAE over the answer tokens
(critic values de-normalised by the running value normaliser), updates the normaliser and the
KL controller, and whitens the advantages; the actor and critic train on minibatches for
``ppo_epochs`` epochs with the clipped policy and value losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import _policy, base, estimators, losses, offpolicy, packed_ops, registry
from restage.algorithms._graphs import (
    ACTOR_GEN,
    ACTOR_TRAIN,
    CRITIC_INF,
    CRITIC_TRAIN,
    REF_INF,
    REWARD_INF,
    reward_source,
    sizes,
    with_proximal,
)
from restage.algorithms.interface import build_graph
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFC, MFCKind


@dataclass(frozen=True)
class Params(_policy.KLPolicyParams):
    ppo_epochs: int = 1
    minibatches: int = 1
    gamma: float = 1.0
    lam: float = 0.95
    value_clip_eps: float = 0.2  # <= 0 turns value clipping off
    adaptive_kl: bool = False  # move kl_coef so the per-sequence KL tracks kl_target
    kl_target: float = 6.0
    kl_horizon: float = 10000.0
    adv_norm: bool = True
    value_norm: bool = True  # the critic learns returns normalised by a running mean/std
    value_norm_eps: float = 1e-5


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    n, p, g, mb = s["prompts"], s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    minibatches = int(cfg.algo.get("minibatches", 1))
    epochs = int(cfg.algo.get("ppo_epochs", 1))
    seq = ("seqs", "prompt_mask")
    gen_out = ("seqs", "prompt_mask", "logprobs") + (("rewards",) if reward_source(cfg) == "function" else ())
    out = [MFC(ACTOR_GEN, MFCKind.GENERATE, "actor", ("prompts",), gen_out, n, p, g, mb)]
    if reward_source(cfg) == "model":
        out.append(MFC(REWARD_INF, MFCKind.INFERENCE, "reward", seq, ("rewards",), n, p, g, mb))
    ref = _policy.config_uses_ref(Params, cfg)
    if ref:
        out.append(MFC(REF_INF, MFCKind.INFERENCE, "ref", seq, ("ref_logprobs",), n, p, g, mb))
    out.append(MFC(CRITIC_INF, MFCKind.INFERENCE, "critic", seq, ("values",), n, p, g, mb))
    train_in = seq + ("logprobs",) + (("ref_logprobs",) if ref else ()) + ("rewards", "values")
    out += [
        MFC(ACTOR_TRAIN, MFCKind.TRAIN_STEP, "actor", train_in, (), n, p, g, mb, minibatches, epochs,
            options=_policy.train_options(cfg)),
        MFC(CRITIC_TRAIN, MFCKind.TRAIN_STEP, "critic", train_in, (), n, p, g, mb, minibatches, epochs),
    ]
    return with_proximal(cfg, out)


def validate(cfg: ExperimentConfig) -> Params:
    params = _policy.validate_kl_policy(Params, cfg)
    base.check_positive(params, "ppo_epochs", "minibatches", "kl_target", "kl_horizon", "value_norm_eps")
    for name in ("gamma", "lam"):
        if not 0.0 <= getattr(params, name) <= 1.0:
            raise ConfigError(f"algo.{name}: {getattr(params, name)} must be in [0, 1]")
    return params


def init_state(cfg: ExperimentConfig, tokenizer=None) -> base.AlgoState:
    p = validate(cfg)
    kl_ctl = (estimators.AdaptiveKLController(p.kl_coef, p.kl_target, p.kl_horizon) if p.adaptive_kl
              else estimators.FixedKLController(p.kl_coef))
    return base.AlgoState(cfg, build_graph(cfg), p, tokenizer, kl_ctl=kl_ctl,
                          value_norm=estimators.ValueNormaliser(p.value_norm_eps))


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    if mfc_name == CRITIC_TRAIN:
        return ("values",)
    return _policy.forward_outputs(Params, mfc_name, cfg)


def prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                  reduce: packed_ops.Reduce = None) -> tuple[Batch, dict]:
    """Adds ``advantages``, ``returns`` and ``old_values`` (per token, on answer tokens; the critic's scale)."""
    p: Params = state.params
    state.begin_step(step)
    kl_ctl, value_norm = state["kl_ctl"], state["value_norm"]
    mask = base.answer_mask(batch)
    cu = batch.cu_seqlens
    rewards = _policy.shaped_rewards(batch, p)
    kl = _policy.ref_kl(batch, p, mask)
    kl_coef = kl_ctl.value
    token_rewards = estimators.kl_shaped_token_rewards(rewards, kl, mask, cu, kl_coef)
    # V(s_t) for action token t is the critic's output one token earlier.
    state_values = packed_ops.shift_right(batch["values"].float(), cu) * mask
    raw_values = (value_norm.denormalise(state_values) if p.value_norm else state_values) * mask
    advantages, returns = estimators.gae(token_rewards, raw_values, mask, cu, p.gamma, p.lam)
    if p.value_norm:
        value_norm.update(returns, mask, reduce)
        targets, old_values = value_norm.normalise(returns) * mask, value_norm.normalise(raw_values) * mask
    else:
        targets, old_values = returns, state_values
    raw_advantages = advantages
    if p.adv_norm:
        advantages = packed_ops.masked_whiten(advantages, mask, reduce=reduce)
    all_seqs = torch.ones(batch.n_seqs, dtype=torch.bool)
    seq_kl, n_seqs = packed_ops.masked_sum(packed_ops.seq_sum(kl, cu), all_seqs, reduce)
    mean_kl = float(seq_kl / n_seqs.clamp(min=1))
    kl_ctl.update(mean_kl, int(n_seqs))
    stats = {
        "reward": float(packed_ops.masked_mean(batch["rewards"].float(), all_seqs, reduce)),
        "shaped_reward": float(packed_ops.masked_mean(rewards, all_seqs, reduce)),
        "kl_coef": kl_coef,
        "advantage": float(packed_ops.masked_mean(raw_advantages, mask, reduce)),
        "return": float(packed_ops.masked_mean(returns, mask, reduce)),
        "value": float(packed_ops.masked_mean(raw_values, mask, reduce)),
        "answer_tokens": float(packed_ops.masked_sum(mask.float(), mask, reduce)[1]),
    }
    if _policy.uses_ref(p):  # without a reference (kl_coef 0) there is no KL to log
        stats["kl"] = mean_kl
    out = batch.with_keys(tokens={"advantages": advantages.float(), "returns": targets.float(),
                                  "old_values": old_values.float()})
    return out, stats


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    p: Params = state.params
    if mfc_name == ACTOR_TRAIN:
        return _policy.actor_loss(micro_batch, outputs, p, at=offpolicy.train_version(cfg, ctx),
                                  norm_tokens=cfg.generation.max_new_tokens)
    if mfc_name == CRITIC_TRAIN:
        mask = base.answer_mask(micro_batch)
        predicted = packed_ops.shift_right(outputs["values"].float(), micro_batch.cu_seqlens)
        value, clip_fraction = losses.value_loss(predicted, micro_batch["old_values"], micro_batch["returns"], mask,
                                                 p.value_clip_eps, outputs.get(registry.LOSS_NORM))
        return value, {"loss": float(value.detach()), "value_clip_fraction": clip_fraction}
    raise ValueError(f"ppo has no train MFC {mfc_name!r}")
