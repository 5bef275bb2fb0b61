"""Rule-based rewards: Python functions over text, selected by ``reward_fn`` in the config.

A reward function takes the batch's prompts and answers as decoded text and returns one float per
answer: ``fn(prompts: list[str], answers: list[str]) -> Sequence[float]`` (with ``**fields``, it also
gets each answer's dataset fields as keyword lists), or is a per-sample reward
(``verifiers.sample_reward``: ``fn(prompt, completion, /, **fields) -> float``, scored on a thread pool;
``algorithms/scoring.py``). It runs on CPU, on whatever process holds the generated tokens, on a pool
thread: ``start_function_rewards`` starts it and returns at once, ``function_rewards`` waits.
``reward_fn`` names a registered reward (``sort``; the verifiers ``math``, ``format``, ``code``, built
from the config's ``rewards`` options) or any importable ``module:function``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch

from restage.algorithms.scoring import PendingScores, RewardPool
from restage.config.sections import RewardsConfig
from restage.data.batch import Batch
from restage.errors import ConfigError

RewardFn = Callable[[list[str], list[str]], Sequence[float]]
AccuracyFn = Callable[[list[str], list[str]], Sequence[bool]]
_REWARDS: dict[str, RewardFn | str] = {"sort": "restage.data.tasks:reward", "arith": "restage.data.arith:reward"}
# A task whose answers are right or wrong also names that test: evaluation reports its accuracy.
_ACCURACY: dict[str, AccuracyFn | str] = {"sort": "restage.data.tasks:correct", "arith": "restage.data.arith:correct"}
# Verifiers: factories that build a per-sample reward from the config's ``rewards`` options.
_VERIFIERS = {name: f"restage.algorithms.verifiers:{name}_reward" for name in ("math", "format", "code")}


def register_reward(name: str, fn: RewardFn | str, accuracy: AccuracyFn | str | None = None) -> None:
    """Make ``fn`` (or its ``module:function`` spec) the reward called ``name``; ``accuracy``, when the task has
    one, says which answers are right (evaluation during training reports the fraction, ``eval/accuracy``)."""
    _REWARDS[name] = fn
    if accuracy is not None:
        _ACCURACY[name] = accuracy
    else:
        _ACCURACY.pop(name, None)


def resolve_accuracy(spec: str) -> AccuracyFn | None:
    """The right-or-wrong test registered with the reward ``spec`` (its name, or the ``module:function`` a name
    stands for), or None when the task has none."""
    target = _ACCURACY.get(spec) or next((_ACCURACY[n] for n, t in _REWARDS.items() if t == spec and n in _ACCURACY),
                                         None)
    return None if target is None else _resolve(target, spec)


def reward_names() -> tuple[str, ...]:
    return (*_REWARDS, *_VERIFIERS)


def resolve_reward(spec: str, options: RewardsConfig | None = None) -> RewardFn:
    """The function a ``reward_fn`` value names (a verifier built from ``options``); a one-line ConfigError
    when it cannot be found."""
    if spec in _VERIFIERS and spec not in _REWARDS:
        fn = _resolve(_VERIFIERS[spec], spec)(options or RewardsConfig())
        fn.__dict__["rebuild"] = (_VERIFIERS[spec], options or RewardsConfig())  # how a worker process builds it
        return fn
    return _resolve(_REWARDS.get(spec, spec), spec)


def _resolve(target, spec: str):
    return resolve_callable(target, spec, "reward_fn", "reward", reward_names())


def resolve_callable(target, spec: str, key: str, kind: str, names: Sequence[str]) -> Callable:
    """``target`` (a registry's entry for ``spec``, or ``spec`` itself) when callable, else the ``module:function`` it
    names, imported; a one-line ConfigError naming the config ``key`` otherwise (rewards, environments)."""
    if callable(target):
        return target
    if ":" not in target:
        raise ConfigError(f"{key}: {spec!r} is neither a registered {kind} ({', '.join(names)}) nor module:function")
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{key}: cannot import module {module_name!r} ({err})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: module {module_name!r} has no callable {attr!r}")
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


def seq_sample_ids(batch: Batch) -> list:
    """The dataset id of each sequence's sample (its group's), or its index when the batch carries no ids."""
    if not batch.ids:
        return list(range(batch.n_seqs))
    return [batch.ids[i // batch.group_size] for i in range(batch.n_seqs)]


def start_function_rewards(batch: Batch, fn: RewardFn, tokenizer, pool: RewardPool, ids_key: str = "seqs",
                           prompt_key: str = "prompt_mask", fields_of=None, options: RewardsConfig | None = None
                           ) -> PendingScores:
    """Decode a batch of generated sequences here, then score them on ``pool``; ``fields_of`` maps a sample id to
    its dataset fields (``datasets.sample_fields``), handed to the reward as keywords."""
    prompts, answers = decode(batch, tokenizer, ids_key, prompt_key)
    return pool.submit(fn, prompts, answers, seq_sample_ids(batch), fields_of, options or RewardsConfig())


def as_tensor(scores: PendingScores) -> torch.Tensor:
    """``[n_seqs]`` float32 rewards, once scored (raises what ``PendingScores.result`` raises)."""
    return torch.tensor(scores.result(), dtype=torch.float32)


def function_rewards(batch: Batch, fn: RewardFn, tokenizer, ids_key: str = "seqs",
                     prompt_key: str = "prompt_mask", fields_of=None, options: RewardsConfig | None = None
                     ) -> torch.Tensor:
    """``[n_seqs]`` float32 rewards of a batch of generated sequences under a reward function, scored now."""
    options = options or RewardsConfig()
    with RewardPool(min(options.workers, batch.n_seqs)) as pool:
        return as_tensor(start_function_rewards(batch, fn, tokenizer, pool, ids_key, prompt_key, fields_of, options))
