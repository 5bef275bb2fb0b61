"""The synthetic task shipped with restage: sort a short string of digits.

Prompt ``sort 3 1 4 1 5 :``, answer ``1 1 3 4 5`` (then end of sequence). The reward is dense so
that a tiny policy improves within tens of RL steps: each answer position earns 1 for the right
digit and ``0.5 * (1 - |a - t| / 9)`` for a wrong digit (``a``) near the right one (``t``), 0 for
a non-digit; the sum is divided by the longer of the target and the answer. Only the exact sorted
answer scores 1.0; answers that are too long, too short or out of order lose credit.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

TASK_WORD = "sort"
END_OF_PROMPT = ":"
DIGITS = tuple("0123456789")
SPECIAL_TOKENS = ("[PAD]", "[BOS]", "[EOS]", "[UNK]")
# The tokenizer's whole vocabulary, in id order: 16 tokens, so it splits evenly for TP up to 16.
VOCAB = SPECIAL_TOKENS + DIGITS + (TASK_WORD, END_OF_PROMPT)
MIN_DIGITS, MAX_DIGITS = 3, 6


def make_prompt(digits: Sequence[str]) -> str:
    return " ".join((TASK_WORD, *digits, END_OF_PROMPT))


def target(prompt: str) -> list[str]:
    """The correct answer's digits for a prompt; [] when the prompt is not a sort prompt."""
    words = prompt.split()
    if TASK_WORD not in words:
        return []
    body = words[words.index(TASK_WORD) + 1:]
    if END_OF_PROMPT in body:
        body = body[:body.index(END_OF_PROMPT)]
    return sorted(w for w in body if w in DIGITS)


def position_credit(want: str, got: str) -> float:
    """1 for the right digit, 0.5 * (1 - distance / 9) for another digit, 0 for anything else."""
    if got == want:
        return 1.0
    if got in DIGITS and want in DIGITS:
        return 0.5 * (1.0 - abs(int(got) - int(want)) / 9.0)
    return 0.0


def score(prompt: str, answer: str) -> float:
    """Sum of position credits / max(len(target), len(answer)): 1.0 only for the exact sorted answer."""
    want, got = target(prompt), answer.split()
    longest = max(len(want), len(got))
    if longest == 0:
        return 0.0
    return sum(position_credit(w, g) for w, g in zip(want, got)) / longest


def reward(prompts: Sequence[str], answers: Sequence[str]) -> list[float]:
    """The task's programmatic reward (the ``reward_fn`` protocol: batched text in, floats out)."""
    return [score(p, a) for p, a in zip(prompts, answers)]


def correct(prompts: Sequence[str], answers: Sequence[str]) -> list[bool]:
    """Whether each answer is exactly the sorted digits (score 1.0): the task's accuracy."""
    return [answer.split() == target(prompt) for prompt, answer in zip(prompts, answers)]


def random_digits(rng: random.Random) -> list[str]:
    """3 to 6 digits with at least two distinct values (so a wrong order always exists)."""
    while True:
        digits = [rng.choice(DIGITS) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS))]
        if len(set(digits)) > 1:
            return digits


def corrupt(answer: Sequence[str], rng: random.Random) -> list[str]:
    """A worse answer: the sorted digits with one descent put in (swap two unequal positions)."""
    out = list(answer)
    pairs = [(i, j) for i in range(len(out)) for j in range(i + 1, len(out)) if out[i] != out[j]]
    i, j = rng.choice(pairs)
    out[i], out[j] = out[j], out[i]
    return out
