"""GRPO: a group of samples per prompt, group-normalised advantages, a KL term; no critic."""

from __future__ import annotations

from restage.algorithms._graphs import reward_source, sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    group = int(cfg.algo.get("group_size", 4))
    n, p, g, mb = s["prompts"] * group, s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    minibatches = int(cfg.algo.get("minibatches", 1))
    epochs = int(cfg.algo.get("ppo_epochs", 1))
    seq = ("seqs", "prompt_mask")
    gen_out = ("seqs", "prompt_mask", "logprobs") + (("rewards",) if reward_source(cfg) == "function" else ())
    out = [MFC("actor_gen", "generate", "actor", ("prompts",), gen_out, n, p, g, mb, options={"group_size": group})]
    if reward_source(cfg) == "model":
        out.append(MFC("reward_inf", "inference", "reward", seq, ("rewards",), n, p, g, mb))
    out.append(MFC("ref_inf", "inference", "ref", seq, ("ref_logprobs",), n, p, g, mb))
    out.append(MFC("actor_train", "train_step", "actor", seq + ("logprobs", "ref_logprobs", "rewards"), (), n, p, g, mb,
                   minibatches, epochs))
    return out
