"""Shared pieces of the algorithms' MFC declarations: the MFC names, and sizes read from the config.

Code that picks behaviour by MFC (``forward_outputs``, ``loss``) compares against these names,
so renaming an MFC is one edit here.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from restage.config.choices import Execution
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError
from restage.graph import MFC, MFCKind

ACTOR_GEN = "actor_gen"
ACTOR_GREEDY_GEN = "actor_greedy_gen"
REWARD_INF = "reward_inf"
GREEDY_REWARD_INF = "greedy_reward_inf"
REF_INF = "ref_inf"
CRITIC_INF = "critic_inf"
ACTOR_PROX = "actor_prox"  # async mode: the proximal policy's log-probs, recomputed before actor_train
ACTOR_TRAIN = "actor_train"
CRITIC_TRAIN = "critic_train"
REWARD_TRAIN = "reward_train"


def sizes(cfg: ExperimentConfig) -> dict:
    """Batch and sequence sizes every algorithm's MFCs are built from."""
    return {
        "prompts": cfg.run.batch_size,
        "prompt_tokens": cfg.dataset.max_prompt_tokens,
        "gen_tokens": cfg.generation.max_new_tokens,
        "answer_tokens": cfg.dataset.max_answer_tokens,
        "micro_batches": cfg.run.micro_batches,
    }


def reward_source(cfg: ExperimentConfig) -> Literal["function", "model"]:
    """``function`` when a rule-based reward is configured, else ``model`` (a reward model MFC)."""
    return "function" if cfg.reward_fn else "model"


def is_async(cfg: ExperimentConfig) -> bool:
    """Whether the job trains asynchronously (``plan.execution: async``): on tokens of older policy versions."""
    return cfg.plan.execution == Execution.ASYNC


def with_proximal(cfg: ExperimentConfig, mfcs: list[MFC]) -> list[MFC]:
    """A policy-gradient graph made ready for ``plan.execution: async``; in sync mode ``mfcs`` unchanged.

    In async mode ``actor_gen`` also outputs ``versions`` (per token: the policy version that produced it,
    -1 on prompt tokens); an ``actor_prox`` inference MFC on the actor recomputes ``prox_logprobs`` with the
    weights about to be trained; ``actor_train`` reads both after ``logprobs`` (the behaviour policy's).
    ``losses.decoupled_policy_loss`` is the objective they feed (docs/algorithms.md, "Asynchronous training").

    In sync mode with ``algo.is_correction`` (tis or mis) the graph gains ``actor_prox`` too (no ``versions``): the
    training layout's log-probs of the generating weights, for the importance-sampling correction
    (``is_correction.py``).
    """
    corrected = str(cfg.algo.get("is_correction", "none")) != "none"
    if not is_async(cfg) and not corrected:
        return mfcs
    names = [m.name for m in mfcs]
    if ACTOR_GEN not in names or ACTOR_TRAIN not in names:
        raise ConfigError(f"plan.execution async and algo.is_correction need MFCs {ACTOR_GEN} and {ACTOR_TRAIN}; "
                          f"{cfg.algorithm} has {', '.join(names)}: set plan.execution=sync and algo.is_correction=none")
    train = mfcs[names.index(ACTOR_TRAIN)]
    if "logprobs" not in train.inputs:
        raise ConfigError(f"plan.execution async: {cfg.algorithm}'s {ACTOR_TRAIN} must read the behaviour policy's "
                          "logprobs to correct for their age; set plan.execution=sync")
    versions = ("versions",) if is_async(cfg) else ()
    out = []
    for mfc in mfcs:
        if mfc.name == ACTOR_GEN:
            mfc = dataclasses.replace(mfc, outputs=mfc.outputs + versions)
        elif mfc.name == ACTOR_TRAIN:
            out.append(MFC(ACTOR_PROX, MFCKind.INFERENCE, mfc.model, mfc.inputs[:2], ("prox_logprobs",), mfc.n_seqs,
                           mfc.prompt_tokens, mfc.gen_tokens, mfc.micro_batches))
            at = mfc.inputs.index("logprobs") + 1
            mfc = dataclasses.replace(mfc, inputs=mfc.inputs[:at] + ("prox_logprobs",) + versions + mfc.inputs[at:])
        out.append(mfc)
    return out
