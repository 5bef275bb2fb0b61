"""Multi-turn episodes of a generate MFC (``environment.name`` set): answers, tool calls, observations, rewards.

Each sample's ``group_size`` episodes start from its prompt (``Environment.reset``; the built-in ``tool_use``
keeps the dataset's prompt ids). A turn is one answer of the policy; it ends at EOS, at the end of a plain-format
tool call (``</call>``, when it is one token) or at its cap. The environment's ``step`` runs on a
thread (tools in the sandbox) while the rollout engine decodes the other episodes (``rollout/turns.py``);
its observation is encoded (text as it is; chat messages by the tokenizer's template, ``episode_feed.observation_ids``) and
appended, and the episode's next turn joins the batch.

An episode ends when ``step`` says done, after ``environment.max_turns`` answers, or when its token budget
(``environment.max_episode_tokens``: answer and observation tokens) has no room for an observation and one more
token. An episode cut before it was done gets ``environment.over_budget_reward`` as its reward; otherwise its
reward is the sum of its steps' rewards.

The output batch is one sequence per episode: prompt, then each answer and observation in order. Its
``prompt_mask`` is 1 on every token the policy did not write (the prompt and every observation), so every
consumer of the answer mask (losses, advantages, GAE's steps, KL, entropy, token counts) sees only what the policy
wrote (docs/algorithms.md, "Multi-turn episodes"); ``logprobs`` and async mode's ``versions`` are 0 and -1 there.

Determinism: turn ``t`` of an episode seeded ``s`` samples with ``request_seed(s, t)`` (turn 0 with ``s``, as a
single-turn generation), so its tokens depend on its context and weights alone, not on its batch or layout.
Under tp or pp the replica's first rank runs the environments and broadcasts, at each check, the turns it
admits and, at the end, the episodes (``episode_feed.ReplicaChannel``): every rank of the replica admits the same turns.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from restage.algorithms.base import AlgoState, CallContext
from restage.algorithms.environments import (
    EnvironmentError,
    EpisodeContext,
    Observation,
    check_reset,
    validate,
)
from restage.algorithms.interface import Algorithm
from restage.algorithms.rewards import resolve_reward
from restage.algorithms.tools import CALL_END
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch, pack_sequences
from restage.data.chat import chat_prompt_ids
from restage.errors import ConfigError
from restage.graph import MFC
from restage.models.decoder import StageModule
from restage.rollout.budget import RolloutLimits
from restage.rollout.sampling import SamplingParams, request_seed
from restage.rollout.turns import NextTurn, TurnEngine
from restage.runtime.step.episode_feed import Episode, EpisodeFeed, ReplicaChannel, ReplicaFeed, observation_ids
from restage.runtime.step.execute import MFCResult, prompt_lists, request_seeds, run_generate, sampling_params


def _contexts(prompts: Batch, cfg: ExperimentConfig, state: AlgoState, call: CallContext,
              group: int) -> list[EpisodeContext]:
    options = cfg.environment
    reward_fn = resolve_reward(cfg.reward_fn, cfg.rewards) if cfg.reward_fn else None
    texts = state.tokenizer.batch_decode(prompt_lists(prompts), skip_special_tokens=True)
    ids = list(prompts.ids) if prompts.ids else list(range(prompts.n_samples))
    return [EpisodeContext(texts[i], dict(call.sample_fields.get(ids[i], {})), ids[i], options, cfg.rewards,
                           reward_fn) for i in range(prompts.n_samples) for _ in range(group)]


def _first_ids(tokenizer: Any, first: Observation, ctx: EpisodeContext, dataset_ids: list[int]) -> list[int]:
    """The episode's prompt ids: the dataset's when ``reset`` gave the prompt back unchanged, else its text
    (after BOS) or its messages through the chat template."""
    if first == ctx.prompt:
        return list(dataset_ids)
    if isinstance(first, str):
        bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return bos + observation_ids(tokenizer, first)
    return chat_prompt_ids(tokenizer, [dict(m) for m in first])


@dataclass(frozen=True)
class EpisodeRecord:
    """A finished episode as the batch and the statistics take it (sent whole from a replica's first rank)."""

    ids: tuple[int, ...]
    policy: tuple[bool, ...]
    logprobs: tuple[float, ...]
    prompt_len: int
    reward: float
    turns: int
    tool_calls: int
    ok_calls: int
    cut: bool
    final_score: float | None
    versions: tuple[int, ...] = ()  # each token's policy version (-1 where the policy did not write it)

    @classmethod
    def of(cls, e: Episode, over_budget_reward: float) -> EpisodeRecord:
        return cls(tuple(e.ids), tuple(e.policy), tuple(e.logprobs), e.prompt_len,
                   over_budget_reward if e.cut else e.reward, e.turns, e.tool_calls, e.ok_calls, e.cut, e.final_score,
                   tuple(e.versions))


def stop_ids(module: StageModule, tokenizer: Any, tool_format: str) -> list[int]:
    """The ids that end a turn: the model's stop tokens, and in the plain format the call's end marker when it is one
    token (a chat template's assistant turn ends at its own end token, after the call, as the template writes it)."""
    ids = list(module.cfg.stop_token_ids)
    if tool_format != "plain":
        return ids
    end = tokenizer.encode(CALL_END[tool_format], add_special_tokens=False)
    return ids + ([int(end[0])] if len(end) == 1 and int(end[0]) != tokenizer.unk_token_id else [])


def run_episodes(module: StageModule, mfc: MFC, prompts: Batch, algo: Algorithm, cfg: ExperimentConfig,
                 state: AlgoState, call: CallContext, seed: int, version: int | None = None) -> MFCResult:
    """``group_size`` episodes per prompt (see the module's docstring); the batch ``run_generate`` would give, one
    sequence per episode, with the episodes' rewards under the MFC's reward key."""
    records, prefill_tokens = play_episodes(module, mfc, prompts, cfg, state, call, seed, version)
    return episodes_result(mfc, prompts, records, version, algo, cfg, state, call, prefill_tokens)


def eval_episodes(module: StageModule, mfc: MFC, prompts: Batch, cfg: ExperimentConfig,
                  state: AlgoState, call: CallContext) -> list[EpisodeRecord]:
    """One greedy episode per held-out prompt (evaluation during training, runtime/step/evaluation.py), every rank of the
    replica holding them all. Greedy turns take no random numbers: the run's streams are as without evaluation."""
    one_each = dataclasses.replace(mfc, greedy=True, options=dataclasses.replace(mfc.options, group_size=1))
    return play_episodes(module, one_each, prompts, cfg, state, call, seed=0)[0]


def final_answer(record: EpisodeRecord) -> tuple[int, ...]:
    """The ids the policy wrote after the episode's last observation (after its prompt when it made no call)."""
    last = max(i for i, policy in enumerate(record.policy) if not policy)
    return record.ids[last + 1:]


def start_episodes(prompts: Batch, cfg: ExperimentConfig, state: AlgoState, call: CallContext,
                   group: int) -> list[Episode]:
    """``group`` new episodes per prompt, reset (a replica's first rank)."""
    factory = validate(cfg.environment)
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise ValueError("multi-turn episodes need the state's tokenizer")
    dataset_ids = [p for p in prompt_lists(prompts) for _ in range(group)]
    episodes = []
    for ctx, ids in zip(_contexts(prompts, cfg, state, call, group), dataset_ids):
        env = factory(ctx)
        first = _first_ids(tokenizer, check_reset(env.reset(), cfg.environment.name), ctx, ids)
        episodes.append(Episode(env, first, [False] * len(first), [0.0] * len(first), [-1] * len(first), len(first)))
    return episodes


def env_pool(cfg: ExperimentConfig, episodes: int) -> cf.ThreadPoolExecutor:
    """The threads environment steps run on (``rewards.workers``)."""
    return cf.ThreadPoolExecutor(max(1, min(cfg.rewards.workers, episodes)))


def run_turns(module: StageModule, cfg: ExperimentConfig, state: AlgoState, params: SamplingParams,
              channel: ReplicaChannel, feed: EpisodeFeed | None, starts: list[NextTurn], seeds: list[int],
              required: int) -> TurnEngine:
    """Run the engine over the episodes seeded ``seeds`` (the feed's, on the replica's first rank, whose ``starts``
    every rank takes) until the first ``required`` are done; returns it."""
    options = cfg.environment
    if state.tokenizer is None:
        raise ValueError("multi-turn episodes need the state's tokenizer")
    starts, longest = channel.share((starts, max((e.prompt_len for e in feed.episodes), default=0))
                                    if feed is not None else None)
    if longest + options.max_episode_tokens > module.cfg.max_positions:
        raise ConfigError(f"a prompt of {longest} tokens + environment.max_episode_tokens={options.max_episode_tokens}"
                          f" exceeds the model's {module.cfg.max_positions} positions; lower max_episode_tokens or the "
                          "prompts")
    row_seeds = [request_seed(s, t) if t else s for s in seeds for t in range(options.max_turns)]
    engine = TurnEngine(module, starts, len(seeds), required, options.max_turns, options.max_episode_tokens,
                        longest + options.max_episode_tokens, row_seeds, params,
                        stop_ids(module, state.tokenizer, options.tool_format),
                        RolloutLimits.of_params(params), ReplicaFeed(feed, channel))
    engine.run()
    return engine


@torch.no_grad()
def play_episodes(module: StageModule, mfc: MFC, prompts: Batch, cfg: ExperimentConfig, state: AlgoState,
                  call: CallContext, seed: int, version: int | None = None) -> tuple[list[EpisodeRecord], int]:
    """The finished episodes of ``prompts`` (``group_size`` each; every rank of the replica gets them all) and the
    tokens the engine prefilled."""
    group = mfc.options.group
    channel = ReplicaChannel(module)
    seeds = request_seeds(prompts, group, seed)
    with env_pool(cfg, len(seeds)) as pool:
        feed = None
        if channel.first:
            feed = EpisodeFeed(start_episodes(prompts, cfg, state, call, group), cfg, state.tokenizer, pool,
                               version=-1 if version is None else version)
        engine = run_turns(module, cfg, state, sampling_params(module, mfc, cfg, seed), channel, feed,
                           feed.first_turns(0, len(seeds)) if feed is not None else [], seeds, len(seeds))
    records = channel.share([EpisodeRecord.of(e, cfg.environment.over_budget_reward) for e in feed.episodes]
                            if feed is not None else None)
    return records, engine.prefill_tokens


def episodes_result(mfc: MFC, prompts: Batch, records: list[EpisodeRecord], version: int | None, algo: Algorithm,
                    cfg: ExperimentConfig, state: AlgoState, call: CallContext, prefill_tokens: int) -> MFCResult:
    """The generate MFC's output batch of finished episodes, and the episodes' statistics."""
    group = mfc.options.group
    reward_keys = [k for k in mfc.outputs if k.endswith("rewards")]
    if not reward_keys:
        raise ConfigError(f"environment.name: {mfc.name} must output the episodes' rewards; set reward_fn (the "
                          "environment's rewards replace it) instead of a reward model")
    seqs = [list(r.ids) for r in records]
    batch = pack_sequences(seqs, group_size=group, key=mfc.outputs[0], prompt_lens=[len(s) for s in seqs],
                           ids=prompts.ids)
    not_policy = torch.tensor([not p for r in records for p in r.policy], dtype=torch.bool)
    tokens = {"prompt_mask": not_policy}
    if "logprobs" in mfc.outputs:
        tokens["logprobs"] = torch.tensor([x for r in records for x in r.logprobs], dtype=torch.float32)
    if "versions" in mfc.outputs:
        if version is None:
            raise ValueError(f"{mfc.name} outputs versions but the runtime gave no policy version")
        tokens["versions"] = torch.tensor([v for r in records for v in r.versions], dtype=torch.int64)
    batch = batch.with_keys(tokens=tokens, seqs={reward_keys[0]: torch.tensor([r.reward for r in records])})
    if mfc.outputs[1] != "prompt_mask":
        batch = batch.renamed({"prompt_mask": mfc.outputs[1]})
    batch = algo.after_generate(mfc.name, batch, cfg, state, call)
    n = max(1, len(records))
    policy_tokens = sum(sum(r.policy) for r in records)
    observed = sum(len(r.policy) - sum(r.policy) - r.prompt_len for r in records)
    scores = [r.final_score for r in records if r.final_score is not None]
    stats = {
        f"{mfc.name}/answer_tokens": policy_tokens / n,
        f"{mfc.name}/observation_tokens": observed / n,
        f"{mfc.name}/turns": sum(r.turns for r in records) / n,
        f"{mfc.name}/tool_calls": sum(r.tool_calls for r in records) / n,
        f"{mfc.name}/tool_call_rate": sum(r.ok_calls > 0 for r in records) / n,
        f"{mfc.name}/failed_calls": sum(r.tool_calls - r.ok_calls for r in records) / n,
        f"{mfc.name}/cut_episodes": sum(r.cut for r in records) / n,
        f"{mfc.name}/prefill_tokens": prefill_tokens / n,
    }
    if scores:
        stats[f"{mfc.name}/final_score"] = sum(scores) / n
    return MFCResult(batch, stats, batch.n_tokens)


__all__ = ["EnvironmentError", "run_episodes", "eval_episodes", "final_answer", "generate_batch"]


def generate_batch(module: StageModule, mfc: MFC, prompts: Batch, algo: Algorithm, cfg: ExperimentConfig,
                   state: AlgoState, call: CallContext, seed: int, version: int | None = None) -> MFCResult:
    """A generate MFC's batch: multi-turn episodes when ``environment.name`` is set, else ``run_generate``'s answers
    (sync and async mode alike)."""
    if cfg.environment.name:
        return run_episodes(module, mfc, prompts, algo, cfg, state, call, seed, version)
    return run_generate(module, mfc, prompts, algo, cfg, state, call, seed, version)
