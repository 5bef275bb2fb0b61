"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): a step's batch holds only groups whose rewards differ.

A generate MFC with the option ``dynamic_sampling_rounds`` (GRPO's ``algo.dynamic_sampling``) runs here instead of
once: its rewards are waited for at once (they decide), and each group whose answers all scored the same (it
teaches a group-relative estimator nothing) leaves its slot empty. Each extra round fills the empty slots with
fresh prompts' groups; after ``dynamic_sampling_rounds`` rounds a slot still empty keeps its first (all-equal)
group, so the batch always holds as many samples as without dynamic sampling (the schedule's routing, micro-batch
and minibatch counts stay as planned).

The rule is a function of the sample, not of the layout: slot ``s`` (first holding dataset sample ``i``) draws its
round-``r`` prompt at ``replacement_position(seed, step, r, i)`` of the training split (uniform, with replacement),
and answers it with the generation seed of round ``r``; so any dp/tp/pp cut of the batch fills every slot with the
same group as one rank does. The dp ranks agree on the number of rounds: each round starts only if any rank of
the generate layout still has an empty slot (one MAX all-reduce over the layout, which every rank makes); a rank
whose slots are full still answers one prompt (discarded) in that round, so replicas stepping in lockstep
(ZeRO-3 in place, expert parallel) still step together.

Sync and async mode alike (in async mode the generate op fills the batch of the step it generates for, keyed by
that step, before buffering it; ``grpo.validate`` refuses partial rollouts, whose groups are begun at one step and
scored at the next). Statistics:
``dynamic_sampling_rounds`` (extra rounds run), ``dynamic_sampling_dropped`` (share of the first round's groups
with equal rewards), ``dynamic_sampling_unfilled`` (share of slots left with an all-equal group) and
``dynamic_sampling_groups`` (groups generated per slot).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from restage.algorithms.base import AlgoState, CallContext, RewardScoring
from restage.algorithms.interface import Algorithm
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch, concat
from restage.graph import MFC
from restage.models.decoder import StageModule
from restage.runtime.step.execute import MFCResult
from restage.runtime.step.multi_turn import generate_batch

OPTION = "dynamic_sampling_rounds"

# generate(prompts, seed) -> the MFC's result (rewards possibly still being scored: RewardScoring.take)
Generate = Callable[[Batch, int], MFCResult]


def generator(module: StageModule, mfc: MFC, algo: Algorithm, cfg: ExperimentConfig, state: AlgoState,
              call: CallContext, version: int | None = None) -> Generate:
    """``generate(prompts, seed)``: one round of the MFC's generation on ``module`` (``multi_turn.generate_batch``:
    single answers, or multi-turn episodes with ``environment.name``); ``version``: async mode's policy version."""
    return lambda prompts, seed: generate_batch(module, mfc, prompts, algo, cfg, state, call, seed, version)


def replacement_position(seed: int, step: int, round_: int, sample_id: int, size: int) -> int:
    """The training-split position of the prompt that replaces slot ``sample_id``'s group in round ``round_``."""
    return random.Random(f"dynamic-sampling:{seed}:{step}:{round_}:{sample_id}").randrange(size)


def informative(rewards: torch.Tensor, group_size: int) -> list[bool]:
    """Per group: whether its rewards are not all equal."""
    grouped = rewards.float().view(-1, group_size)
    return (grouped.max(-1).values > grouped.min(-1).values).tolist()


def _settled(mfc: MFC, result: MFCResult, scoring: RewardScoring | None) -> Batch:
    """The result's batch with its function rewards attached (waiting for them here: they decide what is kept)."""
    pending = scoring.take(mfc.name) if scoring is not None else None
    batch = result.batch
    assert batch is not None
    return pending.attach(batch) if pending is not None else batch


def fill_batch(generate: Generate, mfc: MFC, prompts: Batch, source_batch: Callable[[list[int]], Batch],
               source_size: int, scoring: RewardScoring | None, seed: int, step: int, run_seed: int,
               any_rank: Callable[[bool], bool]) -> MFCResult:
    """Generate ``prompts``' groups, then replace all-equal ones for up to ``mfc.options.dynamic_sampling_rounds`` extra rounds.

    ``source_batch(positions)`` reads prompts from the training split (``source_size`` examples); ``seed`` is the
    step's generation seed (round ``r`` answers with ``seed + r``); ``run_seed`` and ``step`` key the replacement
    prompts; ``any_rank(flag)`` is True when ``flag`` holds on any rank of the generate layout.
    """
    group = mfc.options.group
    assert mfc.options.dynamic_sampling_rounds is not None, f"{mfc.name} has no dynamic sampling"
    max_rounds = mfc.options.dynamic_sampling_rounds
    reward_key = next(k for k in mfc.outputs if k.endswith("rewards"))
    first = generate(prompts, seed)
    batch = _settled(mfc, first, scoring)
    slot_ids = [int(i) for i in prompts.ids] if prompts.ids else list(range(prompts.n_samples))
    keep = informative(batch[reward_key], group)
    chosen: list[Batch | None] = [batch.select([s]) if ok else None for s, ok in enumerate(keep)]
    tokens, generated, rounds = first.tokens, len(slot_ids), 0
    while rounds < max_rounds and any_rank(any(c is None for c in chosen)):
        rounds += 1
        empty = [s for s, c in enumerate(chosen) if c is None]
        # A rank with every slot full answers one prompt all the same (discarded): lockstep replicas step together.
        asked = empty or [0]
        positions = [replacement_position(run_seed, step, rounds, slot_ids[s], source_size) for s in asked]
        result = generate(source_batch(positions), seed + rounds)
        more = _settled(mfc, result, scoring)
        tokens += result.tokens
        if not empty:
            continue
        generated += len(empty)
        for k, (s, ok) in enumerate(zip(empty, informative(more[reward_key], group), strict=True)):
            if ok:
                chosen[s] = more.select([k])
    unfilled = sum(c is None for c in chosen)
    out = concat([c if c is not None else batch.select([s]) for s, c in enumerate(chosen)])
    n = max(1, len(slot_ids))
    stats = dict(first.stats) | {
        f"{mfc.name}/dynamic_sampling_rounds": float(rounds),
        f"{mfc.name}/dynamic_sampling_dropped": sum(not ok for ok in keep) / n,
        f"{mfc.name}/dynamic_sampling_unfilled": unfilled / n,
        f"{mfc.name}/dynamic_sampling_groups": generated / n,
    }
    return MFCResult(out, stats, tokens)
