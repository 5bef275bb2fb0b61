"""The sizes of a multi-turn config's MFCs (``environment.name`` set): what the planner costs (``plan/estimator.py``).

An episode is a sequence of its prompt and up to ``environment.max_episode_tokens`` answer and observation tokens,
so every MFC that reads episodes (inference, training) carries ``gen_tokens = max_episode_tokens``. A generate MFC
decodes only the answers: ``gen_tokens = min(max_turns x max_new_tokens, max_episode_tokens)`` decode steps per
episode (the worst case: every turn to its cap), and the rest of the budget is observation tokens (prefilled, not
decoded). Its ``options`` carry ``turns`` (``max_turns``), ``observation_tokens`` and ``tool_seconds``
(``environment.tool_latency_seconds``, a figure the user gives: one call's wall time); the estimator adds one
prefill of the context per later turn (the engine does not keep a turn's cache across its tool call,
``rollout/turns.py``) and ``(turns - 1) x tool_seconds`` on an episode's path.
"""

from __future__ import annotations

import dataclasses
import typing

from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError
from restage.graph import MFC, Episodes, MFCKind


def check_supported(cfg: ExperimentConfig) -> None:
    """Refuse, in one line, what multi-turn episodes do not run with."""
    if not cfg.reward_fn:
        raise ConfigError("environment.name: set reward_fn (the episodes' rewards take its place; tool_use scores the "
                          "final answer with it) instead of a reward model")


def episode_mfcs(cfg: ExperimentConfig, mfcs: list[MFC]) -> list[MFC]:
    """``mfcs`` sized for multi-turn episodes (the module's docstring); unchanged without an environment."""
    env = cfg.environment
    if not env.name:
        return mfcs
    check_supported(cfg)
    decoded = min(env.max_turns * cfg.generation.max_new_tokens, env.max_episode_tokens)
    out = []
    for mfc in mfcs:
        match mfc.kind:
            case MFCKind.GENERATE:
                episodes = Episodes(env.max_turns, env.max_episode_tokens - decoded, env.tool_latency_seconds)
                options = dataclasses.replace(mfc.options, episodes=episodes)
                out.append(dataclasses.replace(mfc, gen_tokens=decoded, options=options))
            case MFCKind.INFERENCE | MFCKind.TRAIN_STEP:
                out.append(dataclasses.replace(mfc, gen_tokens=env.max_episode_tokens))
            case unknown:
                typing.assert_never(unknown)
    return out
