"""Environments of multi-turn episodes: ``reset`` gives the first messages, ``step(answer)`` the observation, a
reward, and whether the episode is done.

An environment is any object with the two methods of ``Environment``; one is built per episode by the factory
registered under ``environment.name`` (``register_environment``, or a config's ``module:function``), from an
``EpisodeContext`` (the sample's prompt text and dataset fields, the config's tools and reward). What it returns
is checked (``check_reset``, ``check_step``): a wrong type is one ``EnvironmentError`` line naming the
environment and the value, and a bug of the environment, not of the policy, stops the run.

The episode's reward is the sum of its steps' rewards. Observations are text (encoded as it is) or a list of chat
messages (rendered by the tokenizer's chat template, ``runtime/step/multi_turn.py``); their tokens are observation
tokens, which take no gradient (docs/algorithms.md, "Multi-turn episodes").

Built in: ``tool_use``. It starts from the dataset's prompt; each answer's tool calls (``algorithms/tools.py``)
are run in the sandbox and their outputs are the observation; an answer with no call ends the episode, scored by
the config's ``reward_fn`` (the dataset fields passed as for single-turn rewards), plus
``environment.tool_call_reward`` once when a call ran (``ok``) and ``environment.failed_call_reward`` for each
call that did not (unknown tool, malformed, raised, timed out).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from restage.algorithms.rewards import resolve_callable
from restage.algorithms.sandbox import Limits
from restage.algorithms.scoring import score
from restage.algorithms.tools import TOOL_FORMATS, ToolFormat, ToolResult, parse_tool_calls, resolve_tools, run_tool
from restage.config.sections import EnvironmentConfig, RewardsConfig
from restage.errors import ConfigError, RestageError

Message = Mapping[str, str]  # {"role": ..., "content": ...}
Observation = str | Sequence[Message]


class EnvironmentError(RestageError):  # noqa: A001  (restage's, not the builtin alias of OSError)
    """An environment returned a value of the wrong type or shape, or could not be built."""


@dataclass(frozen=True)
class StepResult:
    """One step of an episode: what the policy sees next, the step's reward, and whether the episode is over."""

    observation: Observation
    reward: float
    done: bool
    tool_results: tuple[ToolResult, ...] = ()  # the calls this step ran (statistics: call rate, failures)


class Environment(Protocol):
    def reset(self) -> Observation:
        """The episode's first messages (or text)."""

    def step(self, answer: str) -> StepResult:
        """Take the policy's answer (decoded, special tokens dropped); the observation, reward and whether done."""


@dataclass(frozen=True)
class EpisodeContext:
    """What a factory builds an environment from: the sample's prompt (text) and fields, the config's sections,
    and its reward function (None without ``reward_fn``)."""

    prompt: str
    fields: Mapping[str, object]
    sample_id: int
    options: EnvironmentConfig
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    reward_fn: Callable | None = None
    namespaces: bool = True  # sandbox namespace fences (tests turn them off)


EnvironmentFactory = Callable[[EpisodeContext], Environment]


def _check_observation(value, where: str) -> Observation:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return value
    raise EnvironmentError(f"{where} returned {type(value).__name__} {str(value)[:60]!r}; it must return text or a "
                           'list of {"role": str, "content": str} messages')


def check_reset(value, name: str) -> Observation:
    """``reset``'s value, checked: text or a non-empty list of messages."""
    out = _check_observation(value, f"environment {name!r}: reset()")
    if not out:
        raise EnvironmentError(f"environment {name!r}: reset() returned nothing; the first turn needs a prompt")
    return out


def check_step(value, name: str) -> StepResult:
    """``step``'s value, checked: a ``StepResult`` with an observation, a finite number and a bool."""
    where = f"environment {name!r}: step()"
    if not isinstance(value, StepResult):
        raise EnvironmentError(f"{where} returned {type(value).__name__}; it must return a StepResult(observation, "
                               "reward, done)")
    _check_observation(value.observation, where + ".observation")
    if isinstance(value.reward, bool) or not isinstance(value.reward, (int, float)) or not math.isfinite(value.reward):
        raise EnvironmentError(f"{where}.reward is {value.reward!r}; it must be a finite number")
    if not isinstance(value.done, bool):
        raise EnvironmentError(f"{where}.done is {type(value.done).__name__} {value.done!r}; it must be a bool")
    return value


class ToolUse:
    """The built-in ``tool_use`` environment (the module's docstring)."""

    def __init__(self, ctx: EpisodeContext):
        self.ctx = ctx
        self.tools = resolve_tools(ctx.options.tools)
        self.format: ToolFormat = ctx.options.tool_format
        self.limits = Limits(timeout_seconds=ctx.options.tool_timeout_seconds,
                             memory_bytes=ctx.options.tool_memory_bytes)
        self.shaping = 0.0
        self.called = False  # a call has run (tool_call_reward is given once)
        self.final_score: float | None = None  # the reward_fn's score of the final answer, once done

    def reset(self) -> Observation:
        return self.ctx.prompt  # the dataset's prompt ids are kept as they are (chat template applied or not)

    def step(self, answer: str) -> StepResult:
        calls = parse_tool_calls(answer, self.format, next(iter(self.tools)) if len(self.tools) == 1 else "")
        if not calls:
            return StepResult("", self.shaping + self._final_reward(answer), True)
        results = tuple(run_tool(c, self.tools, self.limits, self.ctx.namespaces) for c in calls)
        opts = self.ctx.options
        credit = self.call_credit(results)
        if not self.called and credit > 0:
            self.called, self.shaping = True, self.shaping + opts.tool_call_reward * credit
        self.shaping += opts.failed_call_reward * sum(r.status != "ok" for r in results)
        if self.format == "chat_template":
            return StepResult([{"role": "tool", "content": self.format_output(r.output)} for r in results], 0.0, False,
                              results)
        return StepResult(" ".join(f"<result> {self.format_output(r.output)} </result>" for r in results), 0.0, False,
                          results)

    def call_credit(self, results: tuple[ToolResult, ...]) -> float:
        """The share of ``tool_call_reward`` a step's calls earn (given once per episode): 1 when one ran."""
        return 1.0 if any(r.status == "ok" for r in results) else 0.0

    def format_output(self, output: str) -> str:
        return output

    def _final_reward(self, answer: str) -> float:
        if self.ctx.reward_fn is None:
            return 0.0
        fields = {self.ctx.sample_id: dict(self.ctx.fields)}
        self.final_score = score(self.ctx.reward_fn, [self.ctx.prompt], [answer], [self.ctx.sample_id], fields,
                                 self.ctx.rewards)[0]
        return self.final_score


class SpelledToolUse(ToolUse):
    """``tool_use`` whose tool outputs are spelled one character per word (``3901`` -> ``3 9 0 1``): the observation
    a word-level tokenizer (the tiny jobs') can encode; an error line is replaced by the word ``error``."""

    def format_output(self, output: str) -> str:
        return "error" if output.startswith("error:") else " ".join(output.replace(" ", ""))


_ENVIRONMENTS: dict[str, EnvironmentFactory | str] = {"tool_use": ToolUse, "tool_use_spelled": SpelledToolUse,
                                                      "arith_tools": "restage.algorithms.arith_env:ArithTools"}


def register_environment(name: str, factory: EnvironmentFactory | str) -> None:
    """Make ``factory`` (or its ``module:function`` spec) the environment called ``name``."""
    _ENVIRONMENTS[name] = factory


def environment_names() -> tuple[str, ...]:
    return tuple(_ENVIRONMENTS)


def resolve_environment(spec: str) -> EnvironmentFactory:
    """The factory ``environment.name`` names; a one-line ConfigError when it cannot be found."""
    return resolve_callable(_ENVIRONMENTS.get(spec, spec), spec, "environment.name", "environment",
                            environment_names())


def validate(options: EnvironmentConfig) -> EnvironmentFactory:
    """Check ``environment:`` (names, limits) and return its factory; one-line ConfigErrors."""
    if options.tool_format not in TOOL_FORMATS:
        raise ConfigError(f"environment.tool_format: {options.tool_format!r} must be one of {', '.join(TOOL_FORMATS)}")
    if options.max_turns < 1 or options.max_episode_tokens < 1:
        raise ConfigError(f"environment.max_turns ({options.max_turns}) and environment.max_episode_tokens "
                          f"({options.max_episode_tokens}) must be >= 1")
    if not options.tool_timeout_seconds > 0 or options.tool_memory_bytes < 1 or options.tool_latency_seconds < 0:
        raise ConfigError("environment.tool_timeout_seconds and tool_memory_bytes must be > 0, tool_latency_seconds "
                          ">= 0")
    resolve_tools(options.tools)
    return resolve_environment(options.name)
