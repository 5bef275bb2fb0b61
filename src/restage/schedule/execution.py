"""How the iterations run: synchronously, or asynchronously with generation ahead of training (``plan.execution``).

The planner decides it (``plan.execution: auto`` compares both) and writes it in the schedule; the runtime
reads it there and dispatches with ``match``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, assert_never

from restage.errors import ConfigError


@dataclass(frozen=True)
class Sync:
    """Every step generates its own batch with the current weights."""


@dataclass(frozen=True)
class Async:
    """Generation runs up to ``staleness`` policy versions ahead of training, the trained weights pushed to it every
    ``push_every`` steps; ``partial``: an answer cut by a push goes on under the new weights (partial rollouts)."""

    staleness: int
    push_every: int
    partial: bool = False


Execution = Sync | Async


def execution_to_json(execution: Execution) -> dict[str, Any]:
    match execution:
        case Sync():
            return {"mode": "sync"}
        case Async(staleness, push_every, partial):
            return {"mode": "async", "staleness": staleness, "push_every": push_every, "partial_rollouts": partial}
        case _:
            assert_never(execution)


def execution_from_json(data: dict[str, Any]) -> Execution:
    match data.get("mode"):
        case "sync":
            return Sync()
        case "async":
            return Async(int(data["staleness"]), int(data["push_every"]), bool(data.get("partial_rollouts", False)))
        case mode:
            raise ConfigError(f"schedule execution mode {mode!r} is neither 'sync' nor 'async'; run `restage plan` "
                              "again")
