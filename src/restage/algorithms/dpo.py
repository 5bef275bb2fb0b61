"""Direct preference optimisation against a frozen reference model (IPO as an option)."""

from __future__ import annotations

from restage.algorithms._graphs import sizes
from restage.config import ExperimentConfig
from restage.graph import MFC


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    n, p, a, mb = 2 * s["prompts"], s["prompt_tokens"], s["answer_tokens"], s["micro_batches"]
    return [
        MFC("ref_inf", "inference", "ref", ("packed_pair_ids", "prompt_mask"), ("ref_logprobs",), n, p, a, mb),
        MFC("actor_train", "train_step", "actor", ("packed_pair_ids", "prompt_mask", "ref_logprobs"), (), n, p, a, mb),
    ]
