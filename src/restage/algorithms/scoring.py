"""Scoring a batch's answers with a rule reward: dataset fields as keywords, a thread pool, bad values reported.

Two kinds of reward function (``algorithms/rewards.py`` resolves both):

* batched, ``fn(prompts, answers, **fields) -> [float]`` (the original protocol, e.g. ``sort``): it is
  given the fields as keyword lists (one value per answer) only when it takes ``**kwargs``;
* per-sample, marked with ``verifiers.sample_reward``: ``fn(prompt, completion, /, **fields) -> float``,
  called for every answer concurrently on ``rewards.workers`` threads (a code reward's sandboxed
  subprocesses run side by side).

Scoring is started (``RewardPool.submit``) and collected (``PendingScores.result``) apart, so the rank
that generated the answers goes on with its next ops while the pool scores them (the runtime collects
the rewards where they are first sent; docs/algorithms.md, "Rewards"). ``score`` does both at once.
Either way the reward runs on a pool thread, never the main thread (so it cannot install signal handlers).

An answer whose per-sample reward raises or is not finite is reported on stderr with its sample id and
scores 0; with ``rewards.on_error: stop`` it stops the run instead (``RewardError``, one line). A batched
reward keeps its contract: one that raises stops the run (it cannot say which answer failed), and a
non-finite value goes to the trainer's non-finite guard (``run.nonfinite``). Both surface when the
scores are collected.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from restage.config import RewardsConfig
from restage.errors import RewardError


def takes_fields(fn: Callable) -> bool:
    """Whether a batched reward takes ``**kwargs`` (and so is given the dataset fields)."""
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class PendingScores:
    """The rewards of one batch being scored on a ``RewardPool``; ``result()`` waits for them."""

    name: str  # the reward's, for messages
    sample_ids: tuple  # the dataset id of each answer
    futures: tuple[Future, ...]  # one per answer (per-sample), or one for the whole batch (batched)
    batched: bool
    options: RewardsConfig

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> list[float]:
        """One reward per answer; raises what a batched reward raised, or ``RewardError`` (on_error: stop)."""
        n = len(self.sample_ids)
        if self.batched:
            # The batched protocol keeps its contract: an exception stops the run on its rank as any exception
            # in an MFC does (it cannot say which answer failed), and a non-finite value reaches the trainer's
            # non-finite guard (run.nonfinite: skip the step's training or stop; runtime/nonfinite.py).
            batched = [float(v) for v in self.futures[0].result()]
            if len(batched) != n:
                raise RewardError(f"reward_fn {self.name} returned {len(batched)} rewards for {n} answers")
            return batched
        failures: list[tuple[object, str]] = []
        values = []
        for sample, future in zip(self.sample_ids, self.futures):
            value = future.result()
            if isinstance(value, float) and not math.isfinite(value):
                value = f"returned {value}"
            if isinstance(value, str):
                failures.append((sample, value))
                value = 0.0
            values.append(value)
        for sample, what in failures:
            line = f"reward {self.name}: sample {sample} {what}"
            if self.options.on_error == "stop":
                raise RewardError(f"{line}; fix the reward (or set rewards.on_error=zero to score such answers 0)")
            print(f"restage: {line}; scored 0 (rewards.on_error=stop stops the run instead)", file=sys.stderr,
                  flush=True)
        return values


class RewardPool:
    """The ``rewards.workers`` threads that score answers; kept for a run so scoring can go on behind other work."""

    def __init__(self, workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="restage-reward")

    def submit(self, fn: Callable, prompts: Sequence[str], answers: Sequence[str], sample_ids: Sequence,
               fields_of: Mapping[int, Mapping] | None = None, options: RewardsConfig = RewardsConfig()
               ) -> PendingScores:
        """Start scoring; ``sample_ids[i]`` is the dataset id of answer ``i`` (its fields' key)."""
        fields_of = fields_of or {}
        fields = [dict(fields_of.get(i, {})) for i in sample_ids]
        name = getattr(fn, "__name__", "reward_fn")
        prompts, answers = list(prompts), list(answers)
        if not getattr(fn, "per_sample", False):
            keywords = {}
            if takes_fields(fn):
                keywords = {key: [f.get(key) for f in fields] for key in dict.fromkeys(k for f in fields for k in f)}
            return PendingScores(name, tuple(sample_ids), (self._executor.submit(fn, prompts, answers, **keywords),),
                                 True, options)

        def one(k: int) -> float | str:
            try:
                return float(fn(prompts[k], answers[k], **fields[k]))
            except Exception as err:  # the reward's own bug or a malformed sample: reported, not fatal
                return f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

        return PendingScores(name, tuple(sample_ids), tuple(self._executor.submit(one, k) for k in range(len(answers))),
                             False, options)

    def close(self) -> None:
        """Stop taking work; scoring already started finishes on its threads."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self._executor.shutdown(wait=True)


def score(fn: Callable, prompts: Sequence[str], answers: Sequence[str], sample_ids: Sequence,
          fields_of: Mapping[int, Mapping] | None = None, options: RewardsConfig = RewardsConfig()) -> list[float]:
    """One reward per answer, scored now on a pool of ``options.workers`` threads (``RewardPool.submit`` + result)."""
    with RewardPool(min(options.workers, max(1, len(answers)))) as pool:
        return pool.submit(fn, prompts, answers, sample_ids, fields_of, options).result()
