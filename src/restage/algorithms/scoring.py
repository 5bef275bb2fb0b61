"""Scoring a batch's answers with a rule reward: dataset fields as keywords, a thread pool, bad values reported.

Two kinds of reward function (``algorithms/rewards.py`` resolves both):

* batched, ``fn(prompts, answers, **fields) -> [float]`` (the original protocol, e.g. ``sort``): it is
  given the fields as keyword lists (one value per answer) only when it takes ``**kwargs``;
* per-sample, marked with ``verifiers.sample_reward``: ``fn(prompt, completion, /, **fields) -> float``,
  called for every answer concurrently on ``rewards.workers`` threads (a code reward's sandboxed
  subprocesses run side by side).

An answer whose per-sample reward raises or is not finite is reported on stderr with its sample id and
scores 0; with ``rewards.on_error: stop`` it stops the run instead (``RewardError``, one line). A batched
reward keeps its contract: one that raises stops the run (it cannot say which answer failed), and a
non-finite value goes to the trainer's non-finite guard (``run.nonfinite``).
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from restage.config import RewardsConfig
from restage.errors import RewardError


def takes_fields(fn: Callable) -> bool:
    """Whether a batched reward takes ``**kwargs`` (and so is given the dataset fields)."""
    try:
        return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def score(fn: Callable, prompts: Sequence[str], answers: Sequence[str], sample_ids: Sequence,
          fields_of: Mapping[int, Mapping] | None = None, options: RewardsConfig = RewardsConfig()) -> list[float]:
    """One reward per answer; ``sample_ids[i]`` is the dataset id of answer ``i`` (its fields' key)."""
    fields_of = fields_of or {}
    fields = [dict(fields_of.get(i, {})) for i in sample_ids]
    name = getattr(fn, "__name__", "reward_fn")
    if not getattr(fn, "per_sample", False):
        keywords = {}
        if takes_fields(fn):
            keywords = {key: [f.get(key) for f in fields] for key in dict.fromkeys(k for f in fields for k in f)}
        # The batched protocol keeps its contract: an exception stops the run on its rank as any exception in
        # an MFC does (it cannot say which answer failed), and a non-finite value reaches the trainer's
        # non-finite guard (run.nonfinite: skip the step's training or stop; runtime/nonfinite.py).
        batched = [float(v) for v in fn(list(prompts), list(answers), **keywords)]
        if len(batched) != len(answers):
            raise RewardError(f"reward_fn {name} returned {len(batched)} rewards for {len(answers)} answers")
        return batched

    def one(k: int) -> float | str:
        try:
            return float(fn(prompts[k], answers[k], **fields[k]))
        except Exception as err:  # the reward's own bug or a malformed sample: reported, not fatal
            return f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"

    with ThreadPoolExecutor(max_workers=min(options.workers, max(1, len(answers)))) as pool:
        results = list(pool.map(one, range(len(answers))))
    failures: list[tuple[object, str]] = []
    values = []
    for sample, value in zip(sample_ids, results):
        if isinstance(value, float) and not math.isfinite(value):
            value = f"returned {value}"
        if isinstance(value, str):
            failures.append((sample, value))
            value = 0.0
        values.append(value)
    for sample, what in failures:
        line = f"reward {name}: sample {sample} {what}"
        if options.on_error == "stop":
            raise RewardError(f"{line}; fix the reward (or set rewards.on_error=zero to score such answers 0)")
        print(f"restage: {line}; scored 0 (rewards.on_error=stop stops the run instead)", file=sys.stderr, flush=True)
    return values
