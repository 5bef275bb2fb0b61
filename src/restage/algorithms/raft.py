"""RAFT: sample n answers per prompt, keep the best by reward, fine-tune on it."""

from __future__ import annotations

from restage.algorithms._graphs import reward_source, sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    group = int(cfg.algo.get("group_size", 4))
    n, p, g, mb = s["prompts"], s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    fn = reward_source(cfg) == "function"
    out = [MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs", "prompt_mask") + (("rewards",) if fn else ()),
               n * group, p, g, mb, options={"group_size": group})]
    if not fn:
        out.append(MFC("reward_inf", "inference", "reward", ("seqs", "prompt_mask"), ("rewards",), n * group, p, g, mb))
    # The best of each group is selected between MFCs; the train step sees one sequence per prompt.
    out.append(MFC("actor_train", "train_step", "actor", ("seqs", "prompt_mask", "rewards"), (), n, p, g, mb))
    return out
