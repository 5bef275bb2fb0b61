"""Rewards that never return for some answers (tests of rewards.timeout_seconds; importable by worker processes)."""

import time

from restage.algorithms.verifiers import sample_reward


def forever(prompts, answers):
    """A batched reward that never returns."""
    while True:
        time.sleep(1.0)


def length(prompts, answers):
    """A batched reward that returns: each answer's length."""
    return [float(len(a)) for a in answers]


@sample_reward
def hangs_on_x(prompt: str, completion: str, /, **fields) -> float:
    """Never returns for an answer containing "x"; else its length."""
    while "x" in completion:
        time.sleep(1.0)
    return float(len(completion))


@sample_reward
def sleeps(prompt: str, completion: str, /, seconds: float = 0.0, **fields) -> float:
    """Returns 1 after the sample's ``seconds``."""
    time.sleep(seconds)
    return 1.0


def exits(prompts, answers):
    """Ends its interpreter in the middle of the call."""
    import os
    os._exit(3)


@sample_reward
def hangs_on_nine(prompt: str, completion: str, /, **fields) -> float:
    """The sort task's answers: never returns for a prompt holding a 9; else 1."""
    while "9" in prompt:
        time.sleep(1.0)
    return 1.0
