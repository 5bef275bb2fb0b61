"""The episodes in play on one replica (``multi_turn.py`` runs them): each episode as it grows, the feed that steps
their environments on threads and builds each next turn from the observation, and the channel that makes every rank
of a tp/pp replica take its first rank's turns."""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from restage.algorithms.environments import Environment, Observation, StepResult, check_step
from restage.config.schema import ExperimentConfig
from restage.data.chat import chat_prompt_ids
from restage.errors import ConfigError
from restage.models.decoder import StageModule
from restage.rollout.turns import NextTurn

# The conversation a tool message is rendered after, to cut the template's rendering of the message alone.
_BEFORE = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


def observation_ids(tokenizer: Any, observation: Observation) -> list[int]:
    """Token ids of an observation: text encoded as it is; messages as the chat template renders them after an
    assistant turn, with the next generation prompt (the template's tokens after ``_BEFORE``)."""
    if isinstance(observation, str):
        return [int(t) for t in tokenizer.encode(observation, add_special_tokens=False)] if observation else []
    before = tokenizer.apply_chat_template(_BEFORE, tokenize=True)
    before = before["input_ids"] if hasattr(before, "keys") else before
    after = chat_prompt_ids(tokenizer, [*_BEFORE, *(dict(m) for m in observation)])
    if list(after[:len(before)]) != list(before):
        raise ConfigError(f"the chat template of {tokenizer.name_or_path} renders an assistant turn differently when "
                          "tool messages follow it; use environment.tool_format=plain with text observations")
    return after[len(before):]


@dataclass
class Episode:
    """One episode as it grows (owned by its feed): its tokens, which the policy wrote, their log-probs and policy
    versions (-1 on tokens the policy did not write), rewards."""

    env: Environment
    ids: list[int]
    policy: list[bool]
    logprobs: list[float]
    versions: list[int]
    prompt_len: int
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    cut: bool = False
    tool_calls: int = 0
    ok_calls: int = 0
    final_score: float | None = None

    @property
    def used(self) -> int:
        return len(self.ids) - self.prompt_len


class EpisodeFeed:
    """The ``TurnFeed`` of a replica's first rank: environment steps on a thread pool, next turns built from them.

    ``required``: the episodes the engine must finish (the first ones; partial rollouts begin later ones behind
    them); ``version``: the policy version its turns' tokens record; ``begun_versions``: row -> the versions of a
    continued turn's tokens written before."""

    def __init__(self, episodes: list[Episode], cfg: ExperimentConfig, tokenizer: Any, pool: cf.Executor,
                 required: int | None = None, version: int = -1):
        self.episodes, self.cfg, self.tokenizer, self.pool = episodes, cfg, tokenizer, pool
        self.options = cfg.environment
        self.required_rows = (len(episodes) if required is None else required) * self.options.max_turns
        self.version = version
        self.running: dict[cf.Future[Any], int] = {}  # environment step -> its turn's row
        self.begun_versions: dict[int, tuple[int, ...]] = {}

    def first_turns(self, first: int, count: int) -> list[NextTurn]:
        """The first turns of episodes ``first .. first + count - 1``."""
        cap = min(self.cfg.generation.max_new_tokens, self.options.max_episode_tokens)
        return [NextTurn(e * self.options.max_turns, tuple(self.episodes[e].ids), cap) for e in range(first, first + count)]

    def turn_done(self, row: int, tokens: list[int], logprobs: list[float]) -> None:
        e, t = divmod(row, self.options.max_turns)
        episode = self.episodes[e]
        before = self.begun_versions.pop(row, ())
        episode.ids += tokens
        episode.policy += [True] * len(tokens)
        episode.logprobs += logprobs
        episode.versions += [*before, *[self.version] * (len(tokens) - len(before))]
        episode.turns = t + 1
        answer = self.tokenizer.decode(tokens, skip_special_tokens=True)
        self.running[self.pool.submit(episode.env.step, answer)] = row

    def take_ready(self, block: bool, timeout: float | None = None) -> list[NextTurn]:
        required = [f for f, row in self.running.items() if row < self.required_rows]
        if block and required:
            cf.wait(required, timeout=timeout, return_when=cf.FIRST_COMPLETED)
        done = [f for f in self.running if f.done()]
        ready = []
        for future in sorted(done, key=lambda f: self.running[f]):  # row order: the same admissions on every run
            row = self.running.pop(future)
            turn = self._after_step(row, check_step(future.result(), self.options.name))
            if turn is not None:
                ready.append(turn)
        return ready

    def pending(self) -> bool:
        return any(row < self.required_rows for row in self.running.values())

    def _after_step(self, row: int, result: StepResult) -> NextTurn | None:
        e, t = divmod(row, self.options.max_turns)
        episode = self.episodes[e]
        episode.reward += float(result.reward)
        episode.tool_calls += len(result.tool_results)
        episode.ok_calls += sum(r.status == "ok" for r in result.tool_results)
        if result.done:
            episode.done = True
            episode.final_score = getattr(episode.env, "final_score", None)
            return None
        observation = observation_ids(self.tokenizer, result.observation)
        room = self.options.max_episode_tokens - episode.used - len(observation)
        if t + 1 >= self.options.max_turns or room < 1:
            episode.cut = True
            return None
        episode.ids += observation
        episode.policy += [False] * len(observation)
        episode.logprobs += [0.0] * len(observation)
        episode.versions += [-1] * len(observation)
        return NextTurn(row + 1, tuple(episode.ids), min(self.cfg.generation.max_new_tokens, room))


class ReplicaChannel:
    """Makes every rank of a tp/pp replica take its first rank's turns (``ReplicaFeed``) and episodes."""

    def __init__(self, module: StageModule):
        ctx = module.ctx
        self.ctx, self.device = ctx, next(module.parameters()).device
        self.single = ctx.tp_size * ctx.pp_size == 1
        self.first = ctx.tp_rank == 0 and ctx.pp_stage == 0

    def share(self, value: Any) -> Any:
        """The first rank's ``value`` on every rank of the replica: over tp on every stage (stage 0's tp ranks then
        hold it), then over pp from stage 0."""
        if self.single:
            return value
        box = [value]
        device = self.device if self.device.type == "cuda" else None
        if self.ctx.tp_group is not None:
            dist.broadcast_object_list(box, src=self.ctx.tp_ranks[0], group=self.ctx.tp_group, device=device)
        if self.ctx.pp_group is not None:
            dist.broadcast_object_list(box, src=self.ctx.pp_ranks[0], group=self.ctx.pp_group, device=device)
        return box[0]


class ReplicaFeed:
    """A feed every rank of a replica calls alike: the first rank's ``EpisodeFeed`` decides, the others follow."""

    def __init__(self, feed: EpisodeFeed | None, channel: ReplicaChannel):
        self.feed, self.channel, self._pending = feed, channel, False

    def turn_done(self, row: int, tokens: list[int], logprobs: list[float]) -> None:
        if self.feed is not None:
            self.feed.turn_done(row, tokens, logprobs)

    def take_ready(self, block: bool, timeout: float | None = None) -> list[NextTurn]:
        mine = (self.feed.take_ready(block, timeout), self.feed.pending()) if self.feed is not None else None
        turns, self._pending = self.channel.share(mine)
        return list(turns)

    def pending(self) -> bool:
        return self._pending
