"""ReMax: REINFORCE with the reward of a greedy generation as the baseline; no critic."""

from __future__ import annotations

from restage.algorithms._graphs import reward_source, sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    n, p, g, mb = s["prompts"], s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    fn = reward_source(cfg) == "function"
    out = [
        MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs", "prompt_mask", "logprobs") + (("rewards",) if fn else ()),
            n, p, g, mb),
        MFC("actor_greedy_gen", "generate", "actor", ("prompts",),
            ("greedy_seqs", "greedy_prompt_mask") + (("baseline_rewards",) if fn else ()), n, p, g, mb, greedy=True),
    ]
    if not fn:
        out += [
            MFC("reward_inf", "inference", "reward", ("seqs", "prompt_mask"), ("rewards",), n, p, g, mb),
            MFC("greedy_reward_inf", "inference", "reward", ("greedy_seqs", "greedy_prompt_mask"), ("baseline_rewards",),
                n, p, g, mb),
        ]
    out.append(MFC("ref_inf", "inference", "ref", ("seqs", "prompt_mask"), ("ref_logprobs",), n, p, g, mb))
    out.append(MFC("actor_train", "train_step", "actor",
                   ("seqs", "prompt_mask", "logprobs", "ref_logprobs", "rewards", "baseline_rewards"), (), n, p, g, mb))
    return out
