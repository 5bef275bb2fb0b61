"""Partial rollouts of multi-turn episodes (``plan.partial_rollouts`` with ``environment.name``): one generate call
finishes a step's episodes and begins the next step's, as ``runtime/step/partial_rollouts.py`` does for answers.

The call of step ``s`` runs the rollout engine (``rollout/turns.py``) over batch ``T = s + ahead``'s episodes
(begun at step ``s - 1``, or new) followed by batch ``T + 1``'s new ones, and stops once all of ``T``'s are done;
``T + 1``'s take slots as ``T``'s turns free them (while ``T``'s tools run, too). What ``T + 1``'s episodes hold
then stays on the replica's first rank (``EpisodesInFlight``), live: their environments, the turn each was in the
middle of (its tokens, log-probs and version so far), the turns queued, and the environment steps still running
on the call's thread pool, which lives on with them. The next call continues them: a cut turn is prefilled again as
context + its tokens so far under the weights the copy holds now and decodes on from its position with its own
noise key, so under unchanged weights every episode equals its uninterrupted play token for token
(``tests/models/test_multi_turn_partial_on_cpu.py``). Each token records the version that wrote it.

Unlike single answers, where an episode is cut depends on when its tools return (a step still running when
``T``'s last episode ends is carried over), so which version wrote which token is not reproducible run to run;
the tokens are, under unchanged weights. Environments cannot be saved, so a checkpoint does not hold
``T + 1``'s begun episodes: after a resume they start again from ``reset`` at the call that finishes them
(docs/algorithms.md, "Multi-turn episodes", Modes).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from restage.algorithms.base import AlgoState, CallContext
from restage.algorithms.interface import Algorithm
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.graph import MFC
from restage.models.decoder import StageModule
from restage.rollout.turns import NextTurn
from restage.runtime.step.episode_feed import Episode, EpisodeFeed, ReplicaChannel
from restage.runtime.step.execute import MFCResult, request_seeds, sampling_params
from restage.runtime.step.multi_turn import EpisodeRecord, env_pool, episodes_result, run_turns, start_episodes


@dataclass
class EpisodesInFlight:
    """A batch's episodes begun by a generate call (rows numbered from the batch's first episode). On the replica's
    first rank: the episodes, their open turns (with tokens so far: ``versions[row]`` their versions), their running
    environment steps and the pool those run on; on its other ranks empty (the first rank decides)."""

    episodes: list[Episode] = field(default_factory=list)
    turns: list[NextTurn] = field(default_factory=list)
    versions: dict[int, tuple[int, ...]] = field(default_factory=dict)
    running: dict[cf.Future[Any], int] = field(default_factory=dict)
    pool: cf.ThreadPoolExecutor | None = None


@torch.no_grad()
def run_partial_episodes(module: StageModule, mfc: MFC, now: Batch, begun: EpisodesInFlight | None,
                         later: Batch | None, algo: Algorithm, cfg: ExperimentConfig, state: AlgoState,
                         call: CallContext, seeds: tuple[int, int], version: int
                         ) -> tuple[MFCResult, int, EpisodesInFlight | None]:
    """Finish the episodes of ``now`` (``begun``: those begun earlier, None: none) and begin ``later``'s (None: no
    later step); returns ``now``'s result, the version of its oldest policy token and ``later``'s episodes in
    flight. ``seeds``: the two batches' step seeds."""
    group = mfc.options.group
    turns = cfg.environment.max_turns
    channel = ReplicaChannel(module)
    now_seeds = request_seeds(now, group, seeds[0])
    later_seeds = request_seeds(later, group, seeds[1]) if later is not None else []
    required = len(now_seeds)
    feed, starts = None, []
    if channel.first:
        pool = begun.pool if begun is not None and begun.pool is not None else env_pool(cfg, required + len(later_seeds))
        if begun is not None:
            assert len(begun.episodes) == required, f"{mfc.name}: {len(begun.episodes)} episodes begun for {required}"
            episodes, starts = begun.episodes, list(begun.turns)
        else:
            episodes = start_episodes(now, cfg, state, call, group)
        episodes += start_episodes(later, cfg, state, call, group) if later is not None else []
        feed = EpisodeFeed(episodes, cfg, state.tokenizer, pool, required=required, version=version)
        if begun is not None:
            feed.running, feed.begun_versions = dict(begun.running), dict(begun.versions)
        else:
            starts = feed.first_turns(0, required)
        starts += feed.first_turns(required, len(later_seeds))
    engine = run_turns(module, cfg, state, sampling_params(module, mfc, cfg, seeds[0]), channel, feed, starts,
                       now_seeds + later_seeds, required)
    open_turns = engine.open_turns()
    in_flight = EpisodesInFlight() if later is not None else None
    summary = None
    if feed is not None:
        offset = required * turns
        begun_later = feed.episodes[required:]
        if in_flight is not None:
            moved = [dataclasses.replace(t, row=t.row - offset) for t in open_turns]
            in_flight = EpisodesInFlight(begun_later, moved, {t.row: (version,) * len(t.tokens) for t in moved},
                                         {f: row - offset for f, row in feed.running.items()}, pool)
        else:
            pool.shutdown(wait=True)  # the last step: nothing continues on it
        written = {t.row // turns - required: len(t.tokens) for t in open_turns}  # one open turn per episode at most
        unfinished = [e for e, episode in enumerate(begun_later) if not (episode.done or episode.cut)]
        cut = [e for e in unfinished if written.get(e, 0) or any(begun_later[e].policy)]
        tokens = sum(sum(e.policy) for e in begun_later) + sum(written.values())
        summary = ([EpisodeRecord.of(e, cfg.environment.over_budget_reward) for e in feed.episodes[:required]],
                   len(cut) / max(1, len(begun_later)), tokens / max(1, len(begun_later)))
    records, cut_samples, cut_tokens = channel.share(summary)
    result = episodes_result(mfc, now, records, version, algo, cfg, state, call, engine.prefill_tokens)
    result.stats[f"{mfc.name}/cut_samples"] = cut_samples
    result.stats[f"{mfc.name}/cut_tokens"] = cut_tokens
    oldest = min((v for r in records for v, policy in zip(r.versions, r.policy) if policy), default=version)
    return result, oldest, in_flight
