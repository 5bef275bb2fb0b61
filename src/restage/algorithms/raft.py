"""RAFT: sample n answers per prompt, keep the best by reward, fine-tune on it (SFT loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from restage.algorithms import base, losses, packed_ops
from restage.algorithms._graphs import ACTOR_GEN, ACTOR_TRAIN, REWARD_INF, reward_source, sizes
from restage.algorithms.interface import build_graph
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC, MFCKind, MFCOptions


@dataclass(frozen=True)
class Params:
    group_size: int = 4  # answers sampled per prompt; the best one is trained on


def mfcs(cfg: ExperimentConfig) -> list[MFC]:
    s = sizes(cfg)
    group = int(cfg.algo.get("group_size", 4))
    n, p, g, mb = s["prompts"], s["prompt_tokens"], s["gen_tokens"], s["micro_batches"]
    fn = reward_source(cfg) == "function"
    out = [MFC(ACTOR_GEN, MFCKind.GENERATE, "actor", ("prompts",), ("seqs", "prompt_mask") + (("rewards",) if fn else ()),
               n * group, p, g, mb, options=MFCOptions(group_size=group))]
    if not fn:
        out.append(MFC(REWARD_INF, MFCKind.INFERENCE, "reward", ("seqs", "prompt_mask"), ("rewards",), n * group, p, g, mb))
    # The best of each group is selected between MFCs; the train step sees one sequence per prompt.
    out.append(MFC(ACTOR_TRAIN, MFCKind.TRAIN_STEP, "actor", ("seqs", "prompt_mask", "rewards"), (), n, p, g, mb))
    return out


def validate(cfg: ExperimentConfig) -> Params:
    params = base.parse_params(Params, cfg)
    base.check_positive(params, "group_size")
    base.check_reward_source(cfg)
    return params


def forward_outputs(mfc_name: str, cfg: ExperimentConfig) -> tuple[str, ...]:
    if mfc_name == ACTOR_TRAIN:
        return ("logprobs",)
    return base.default_forward_outputs(build_graph(cfg), mfc_name)


def best_of_groups(rewards: torch.Tensor, group_size: int) -> list[int]:
    """Index of the highest-reward sequence of each consecutive group (the first one on ties)."""
    grouped = rewards.view(-1, group_size)
    return (torch.argmax(grouped, dim=-1) + torch.arange(grouped.shape[0]) * group_size).tolist()


def prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                  reduce: packed_ops.Reduce = None) -> tuple[Batch, dict]:
    """Keeps the best sequence of each group (one per prompt, groups of 1)."""
    p: Params = state.params
    if batch.group_size != p.group_size:
        raise ValueError(f"raft: batch has groups of {batch.group_size}, algo.group_size is {p.group_size}")
    rewards = batch["rewards"].float()
    best = best_of_groups(rewards, p.group_size)
    selected = batch.select_seqs(best, group_size=1, ids=batch.ids)
    stats = {
        "reward": float(packed_ops.masked_mean(rewards, torch.ones_like(rewards, dtype=torch.bool), reduce)),
        "best_reward": float(packed_ops.masked_mean(rewards[best], torch.ones(len(best), dtype=torch.bool), reduce)),
    }
    return selected, stats


def loss(mfc_name: str, micro_batch: Batch, outputs: dict, cfg: ExperimentConfig, state: base.AlgoState,
         ctx: base.CallContext = base.CallContext()) -> tuple[torch.Tensor, dict]:
    if mfc_name != ACTOR_TRAIN:
        raise ValueError(f"raft has no train MFC {mfc_name!r}")
    mask = base.answer_mask(micro_batch)
    value = losses.sft_loss(outputs["logprobs"], mask)
    return value, {"loss": float(value.detach()), "answer_tokens": float(mask.sum())}
