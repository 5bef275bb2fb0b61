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

Time limits (``rewards.timeout_seconds`` on each call, ``rewards.batch_timeout_seconds`` on a batch from the start
of its scoring): with either set, each call runs in a worker process (``timelimit.TimeLimitedWorkers``, one per
thread, started on first use) that is killed at the limit. An answer whose call did not return scores
``rewards.timeout_score``, one stderr line per batch names the reward and the samples, and the share of such
answers is the step's ``<mfc>/reward_timed_out``; with ``rewards.on_timeout: stop`` the run stops instead
(``RewardError``, one line). A batched reward's call is the batch: every answer of it counts as timed out.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pickle
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

from restage.algorithms.timelimit import TimeLimitedWorkers, TimeLimitExceeded
from restage.config.sections import RewardsConfig
from restage.errors import ConfigError, RewardError


def takes_fields(fn: Callable) -> bool:
    """Whether a batched reward takes ``**kwargs`` (and so is given the dataset fields)."""
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class TimedOut:
    """What a call that ran past its limit scores as, until ``PendingScores.result`` handles it."""

    limit: str  # "rewards.timeout_seconds=2": the limit it ran past


@dataclass(frozen=True)
class Rebuilt:
    """A verifier sent to a worker process as its factory and options (its closure does not pickle); rebuilt there
    once per process."""

    factory: str  # module:function of the factory
    options: RewardsConfig

    def __call__(self, *args, **kwargs):
        return _rebuild(self)(*args, **kwargs)

    def prepare(self) -> None:
        """Build it (a worker process calls this when it loads it, outside any call's time limit)."""
        _rebuild(self)


@cache
def _rebuild(recipe: Rebuilt) -> Callable:
    module, _, name = recipe.factory.partition(":")
    return getattr(importlib.import_module(module), name)(recipe.options)


def limited(options: RewardsConfig) -> bool:
    """Whether the reward runs under a time limit (in worker processes)."""
    return options.timeout_seconds > 0 or options.batch_timeout_seconds > 0


def sendable(fn: Callable) -> Callable:
    """What a worker process is sent to run ``fn``: a verifier's recipe, or ``fn`` itself when it pickles (by
    reference: a module-level function); a one-line ConfigError otherwise."""
    recipe = getattr(fn, "rebuild", None)
    if recipe is not None:
        return Rebuilt(*recipe)
    try:
        pickle.dumps(fn)
    except Exception:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(f"reward_fn {name}: a time limit (rewards.timeout_seconds or batch_timeout_seconds) runs "
                          "the reward in worker processes, and it cannot be sent to one; define it at the top level "
                          "of an importable module, or set both limits to 0") from None
    return fn


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

    def timed_out(self) -> int:
        """How many answers ran past a time limit (once scored)."""
        if self.batched:
            return len(self.sample_ids) if isinstance(self.futures[0].result(), TimedOut) else 0
        return sum(isinstance(f.result(), TimedOut) for f in self.futures)

    def result(self) -> list[float]:
        """One reward per answer; raises what a batched reward raised, or ``RewardError`` (on_error: stop,
        on_timeout: stop)."""
        n = len(self.sample_ids)
        if self.batched:
            # The batched protocol keeps its contract: an exception stops the run on its rank as any exception
            # in an MFC does (it cannot say which answer failed), and a non-finite value reaches the trainer's
            # non-finite guard (run.nonfinite: skip the step's training or stop; runtime/step/nonfinite.py).
            returned = self.futures[0].result()
            if isinstance(returned, TimedOut):
                self._timed_out(list(self.sample_ids), [returned], n)
                return [self.options.timeout_score] * n
            batched = [float(v) for v in returned]
            if len(batched) != n:
                raise RewardError(f"reward_fn {self.name} returned {len(batched)} rewards for {n} answers")
            return batched
        failures: list[tuple[object, str]] = []
        late: list[tuple[object, TimedOut]] = []
        values = []
        for sample, future in zip(self.sample_ids, self.futures):
            value = future.result()
            if isinstance(value, TimedOut):
                late.append((sample, value))
                value = self.options.timeout_score
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
        if late:
            self._timed_out([sample for sample, _ in late], [t for _, t in late], n)
        return values

    def _timed_out(self, samples: list, late: list[TimedOut], n: int) -> None:
        """The one line for a batch's answers that ran past a limit: a warning, or ``RewardError`` (on_timeout: stop)."""
        ids = list(dict.fromkeys(samples))
        shown = ", ".join(map(str, ids[:8])) + (f", ... ({len(ids)} samples)" if len(ids) > 8 else "")
        line = (f"reward {self.name}: sample{'s' if len(ids) > 1 else ''} {shown} did not return within "
                f"{' or '.join(sorted({t.limit for t in late}))} "
                f"({len(samples)} of {n} answers)")
        if self.options.on_timeout == "stop":
            raise RewardError(f"{line}; fix the reward or raise the limit (or set rewards.on_timeout=score to score "
                              "such answers rewards.timeout_score)")
        print(f"restage: {line}; scored {self.options.timeout_score:g} (rewards.on_timeout=stop stops the run "
              "instead)", file=sys.stderr, flush=True)


class RewardPool:
    """The ``rewards.workers`` threads that score answers; kept for a run so scoring can go on behind other work."""

    def __init__(self, workers: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="restage-reward")
        self._workers = max(1, workers)
        self._processes: TimeLimitedWorkers | None = None  # started by the first scoring under a time limit

    def _call(self, fn: Callable, args: tuple, kwargs: dict, options: RewardsConfig, deadline: float | None
              ) -> object:
        """``fn(*args, **kwargs)``: here, or under the time limits in a worker process (``TimedOut`` past them)."""
        if not limited(options):
            return fn(*args, **kwargs)
        limits = [(options.timeout_seconds, f"rewards.timeout_seconds={options.timeout_seconds:g}")] * (
            options.timeout_seconds > 0)
        if deadline is not None:
            limits.append((deadline - time.monotonic(),
                           f"rewards.batch_timeout_seconds={options.batch_timeout_seconds:g}"))
        seconds, which = min(limits)
        if seconds <= 0:
            return TimedOut(which)  # the batch's time was spent before this answer's turn
        assert self._processes is not None
        try:
            return self._processes.call(fn, args, kwargs, seconds)
        except TimeLimitExceeded:
            return TimedOut(which)

    def submit(self, fn: Callable, prompts: Sequence[str], answers: Sequence[str], sample_ids: Sequence,
               fields_of: Mapping[int, Mapping] | None = None, options: RewardsConfig = RewardsConfig()
               ) -> PendingScores:
        """Start scoring; ``sample_ids[i]`` is the dataset id of answer ``i`` (its fields' key)."""
        fields_of = fields_of or {}
        fields = [dict(fields_of.get(i, {})) for i in sample_ids]
        name = getattr(fn, "__name__", "reward_fn")
        prompts, answers = list(prompts), list(answers)
        run = fn
        deadline = None
        if limited(options):
            run = sendable(fn)
            if self._processes is None:
                self._processes = TimeLimitedWorkers(self._workers)
            if options.batch_timeout_seconds > 0:
                deadline = time.monotonic() + options.batch_timeout_seconds
        if not getattr(fn, "per_sample", False):
            keywords = {}
            if takes_fields(fn):
                keywords = {key: [f.get(key) for f in fields] for key in dict.fromkeys(k for f in fields for k in f)}
            return PendingScores(name, tuple(sample_ids), (self._executor.submit(
                self._call, run, (prompts, answers), keywords, options, deadline),), True, options)

        def one(k: int) -> float | str | TimedOut:
            try:
                value = self._call(run, (prompts[k], answers[k]), fields[k], options, deadline)
                return value if isinstance(value, TimedOut) else float(value)  # type: ignore[arg-type]
            except Exception as err:  # the reward's own bug or a malformed sample: reported, not fatal
                return f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

        return PendingScores(name, tuple(sample_ids), tuple(self._executor.submit(one, k) for k in range(len(answers))),
                             False, options)

    def close(self) -> None:
        """Stop taking work; scoring already started finishes on its threads (under a time limit: its worker
        processes are killed)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            self._processes.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self._executor.shutdown(wait=True)
        if self._processes is not None:
            self._processes.close()


def score(fn: Callable, prompts: Sequence[str], answers: Sequence[str], sample_ids: Sequence,
          fields_of: Mapping[int, Mapping] | None = None, options: RewardsConfig = RewardsConfig()) -> list[float]:
    """One reward per answer, scored now on a pool of ``options.workers`` threads (``RewardPool.submit`` + result)."""
    with RewardPool(min(options.workers, max(1, len(answers)))) as pool:
        return pool.submit(fn, prompts, answers, sample_ids, fields_of, options).result()
