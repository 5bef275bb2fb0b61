"""PPO with a critic, a reference model and a reward model (or a rule-based reward)."""

from __future__ import annotations

from restage.algorithms._graphs import reward_source, sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    n, p, g, mb = s["prompts"], s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    minibatches = int(cfg.algo.get("minibatches", 1))
    epochs = int(cfg.algo.get("ppo_epochs", 1))
    seq = ("seqs", "prompt_mask")
    gen_out = ("seqs", "prompt_mask", "logprobs") + (("rewards",) if reward_source(cfg) == "function" else ())
    out = [MFC("actor_gen", "generate", "actor", ("prompts",), gen_out, n, p, g, mb)]
    if reward_source(cfg) == "model":
        out.append(MFC("reward_inf", "inference", "reward", seq, ("rewards",), n, p, g, mb))
    out += [
        MFC("ref_inf", "inference", "ref", seq, ("ref_logprobs",), n, p, g, mb),
        MFC("critic_inf", "inference", "critic", seq, ("values",), n, p, g, mb),
    ]
    train_in = seq + ("logprobs", "ref_logprobs", "rewards", "values")
    out += [
        MFC("actor_train", "train_step", "actor", train_in, (), n, p, g, mb, minibatches, epochs),
        MFC("critic_train", "train_step", "critic", train_in, (), n, p, g, mb, minibatches, epochs),
    ]
    return out
