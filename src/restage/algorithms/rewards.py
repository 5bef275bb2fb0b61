"""Rule-based rewards: Python functions over text, selected by ``reward_fn`` in the config.

A reward function takes the batch's prompts and answers as decoded text and returns one float per
answer: ``fn(prompts: list[str], answers: list[str]) -> Sequence[float]``. It runs on CPU, on
whatever process holds the generated tokens. ``reward_fn`` names a registered reward (``sort``)
or any importable ``module:function``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

from restage.data.batch import Batch
from restage.errors import ConfigError

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
AccuracyFn = Callable[[list[str], list[str]], Sequence[bool]]
_REWARDS: dict[str, RewardFn | str] = {"sort": "restage.data.tasks:reward"}
# A task whose answers are right or wrong also names that test: evaluation reports its accuracy.
_ACCURACY: dict[str, AccuracyFn | str] = {"sort": "restage.data.tasks:correct"}


def register_reward(name: str, fn: RewardFn | str, accuracy: AccuracyFn | str | None = None) -> None:
    """Make ``fn`` (or its ``module:function`` spec) the reward called ``name``; ``accuracy``, when the task has
    one, says which answers are right (evaluation during training reports the fraction, ``eval/accuracy``)."""
    _REWARDS[name] = fn
    if accuracy is not None:
        _ACCURACY[name] = accuracy
    else:
        _ACCURACY.pop(name, None)


def resolve_accuracy(spec: str) -> AccuracyFn | None:
    """The right-or-wrong test registered with the reward ``spec``, or None when the task has none."""
    target = _ACCURACY.get(spec)
    return None if target is None else _resolve(target, spec)


def resolve_reward(spec: str) -> RewardFn:
    """The function a ``reward_fn`` value names; a one-line ConfigError when it cannot be found."""
    return _resolve(_REWARDS.get(spec, spec), spec)


def _resolve(target, spec: str):
    if callable(target):
        return target
    if ":" not in target:
        raise ConfigError(f"reward_fn: {spec!r} is neither a registered reward ({', '.join(_REWARDS)}) nor module:function")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"reward_fn: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward_fn: module {module_name!r} has no function {attr!r}")
    return fn


def decode(batch: Batch, tokenizer, ids_key: str = "seqs", prompt_key: str = "prompt_mask") -> tuple[list[str], list[str]]:
    """(prompts, answers) of every sequence as text; an answer stops at its first EOS, special tokens dropped."""
    ids = batch[ids_key].tolist()
    in_prompt = batch[prompt_key].tolist()
    prompts, answers, start = [], [], 0
    eos = tokenizer.eos_token_id
    for n in batch.seqlens:
        seq, mask = ids[start:start + n], in_prompt[start:start + n]
        start += n
        prompt = [t for t, m in zip(seq, mask) if m]
        answer = [t for t, m in zip(seq, mask) if not m]
        if eos in answer:
            answer = answer[:answer.index(eos)]
        prompts.append(prompt)
        answers.append(answer)
    # One call each: the fast tokenizer decodes a whole batch at a fraction of the per-sequence cost.
    return (tokenizer.batch_decode(prompts, skip_special_tokens=True),
            tokenizer.batch_decode(answers, skip_special_tokens=True))


def function_rewards(batch: Batch, fn: RewardFn, tokenizer, ids_key: str = "seqs",
                     prompt_key: str = "prompt_mask") -> torch.Tensor:
    """``[n_seqs]`` float32 rewards of a batch of generated sequences under a reward function."""
    prompts, answers = decode(batch, tokenizer, ids_key, prompt_key)
    values = list(fn(prompts, answers))
    if len(values) != len(answers):
        raise ConfigError(f"reward_fn returned {len(values)} rewards for {len(answers)} answers")
    return torch.tensor([float(v) for v in values], dtype=torch.float32)
