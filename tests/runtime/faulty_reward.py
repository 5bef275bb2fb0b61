"""A rule-based reward that raises on its third call: an exception inside an MFC (the generate MFC)."""

CALLS = {"n": 0}


def reward(prompts, answers):
    CALLS["n"] += 1
    if CALLS["n"] >= 3:
        raise ValueError("reward function broke on purpose")
    return [0.0 for _ in prompts]


def broken(prompts, answers):
    """Raises on its first call: a run that fails before its first step ends."""
    raise ValueError("reward function broke before the first step")
