"""Verifiable rewards: math (answer equals the reference), format (a regex) and code (tests pass in a sandbox).

Each is a *per-sample* reward, ``fn(prompt, completion, /, **fields) -> float``, built from the
config's ``rewards`` section by its factory (``math_reward(options)``, ...) and registered in
``algorithms/rewards.py`` as ``math``, ``format`` and ``code``. ``fields`` are the sample's other
dataset fields: math reads the reference from ``rewards.reference_field``, code its tests from
``rewards.tests_field``.

Math: the final answer is the last ``\\boxed{...}`` of the completion, else its last number; it is
compared with the reference by value and symbolic equivalence by ``math-verify`` (the ``verify``
extra), whose own timeouts use signals and so are off in the scoring threads: answers and
references longer than ``MAX_ANSWER_CHARS`` score 0 instead.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence

from restage.algorithms.sandbox import Limits, run_test
from restage.config.sections import RewardsConfig
from restage.errors import ConfigError

SampleReward = Callable[..., float]
MAX_ANSWER_CHARS = 300
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def sample_reward(fn: SampleReward) -> SampleReward:
    """Mark ``fn(prompt, completion, /, **fields) -> float`` as a per-sample reward (scored concurrently)."""
    fn.__dict__["per_sample"] = True  # read by algorithms.scoring
    return fn


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    open_at = text.find("{", start)
    if open_at < 0:
        return None
    depth = 0
    for i in range(open_at, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_at + 1:i]
    return None


def final_answer(completion: str) -> str | None:
    """The completion's final answer: the last boxed expression, else the last number, else None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(completion)
    return numbers[-1].replace(",", "") if numbers else None


def reference_answer(text: str) -> str:
    """A reference's final answer: its last boxed expression, else what follows GSM8K's ``####``, else the text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    return text.rpartition("####")[2].strip().replace(",", "") if "####" in text else text.strip()


def math_equal(answer: str, reference: str) -> bool:
    """Whether two final answers are equal by value or symbolically (math-verify)."""
    try:
        from math_verify import parse, verify  # optional: the `verify` extra
    except ImportError:
        raise ConfigError("reward_fn math needs math-verify; pip install 'restage[verify]'") from None
    if len(answer) > MAX_ANSWER_CHARS or len(reference) > MAX_ANSWER_CHARS:
        return False

    def parsed(text: str):
        # Wrapped in $...$ so LaTeX (\frac, \sqrt) and plain expressions (1/2, 0.5) both parse.
        return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)

    gold, target = parsed(reference), parsed(answer)
    return bool(gold and target and verify(gold, target, timeout_seconds=None))


def math_reward(options: RewardsConfig) -> SampleReward:
    """1.0 when the completion's final answer equals ``fields[options.reference_field]``, else 0.0."""
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call that timeouts are off
    name = options.reference_field

    @sample_reward
    def math(prompt: str, completion: str, /, **fields) -> float:
        if name not in fields:
            raise KeyError(f"the sample has no field {name!r} (rewards.reference_field); it has {', '.join(fields)}")
        answer = final_answer(completion)
        reference = reference_answer(str(fields[name]))
        return float(answer is not None and math_equal(answer, reference))

    math.__dict__["right_or_wrong"] = True  # evaluation reports the fraction scoring 1 as eval/accuracy
    return math


def format_reward(options: RewardsConfig) -> SampleReward:
    """1.0 when the whole completion matches ``rewards.format_pattern``, else 0.0."""
    if not options.format_pattern:
        raise ConfigError("reward_fn format needs rewards.format_pattern (a regex the whole answer must match)")
    try:
        pattern = re.compile(options.format_pattern, re.DOTALL)
    except re.error as err:
        raise ConfigError(f"rewards.format_pattern: not a valid regex ({err})") from None

    @sample_reward
    def format(prompt: str, completion: str, /, **fields) -> float:  # noqa: A001  (the reward's name)
        return float(pattern.fullmatch(completion.strip()) is not None)

    format.__dict__["right_or_wrong"] = True  # evaluation reports the fraction scoring 1 as eval/accuracy
    return format


def code_of(completion: str) -> str:
    """The code of a completion: its last fenced Python block, else the whole text."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def tests_of(value) -> list[str]:
    """Tests as a list of Python snippets; a JSON list in a string is accepted (parquet and CSV store them so)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [value]
    if not isinstance(value, Sequence) or not value or not all(isinstance(t, str) for t in value):
        raise ValueError(f"tests must be a non-empty list of Python snippets, got {str(value)[:60]}")
    return list(value)


def code_reward(options: RewardsConfig) -> SampleReward:
    """The fraction of ``fields[options.tests_field]`` that pass after the completion's code, each run sandboxed."""
    limits = Limits(timeout_seconds=options.code_timeout_seconds, memory_bytes=options.code_memory_bytes)
    name = options.tests_field

    @sample_reward
    def code(prompt: str, completion: str, /, **fields) -> float:
        if name not in fields:
            raise KeyError(f"the sample has no field {name!r} (rewards.tests_field); it has {', '.join(fields)}")
        tests = tests_of(fields[name])
        program = code_of(completion)
        return sum(run_test(program, test, limits) for test in tests) / len(tests)

    return code
