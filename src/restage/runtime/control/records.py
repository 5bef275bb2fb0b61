"""What the ranks and the master send each other every step over MPI (pickled by mpi4py).

Typed records, one frozen dataclass per kind of row, so a reader names the field it wants instead
of counting to it. Every field is plain data (str, int, float, dict), so the records pickle and
unpickle on every rank alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal


class MoveKind(StrEnum):
    """A MoveRecord's: a parameter reallocation (an EMA and an async push are ones) or a data transfer."""

    REALLOC = "realloc"
    TRANSFER = "transfer"


def merge_rule(name: str) -> Literal["max", "min", "mean"]:
    """How a statistic combines over micro-batches and ranks: ``*_max`` by its largest value, ``*_min`` by its
    smallest, every other one by its (sample-weighted) mean. A mean of per-micro-batch maxima depends on how the
    batch was cut, so it would differ between layouts that train the same."""
    return "max" if name.endswith("_max") else "min" if name.endswith("_min") else "mean"


@dataclass(frozen=True)
class MFCRecord:
    """One MFC as one rank ran it; tokens and FLOPs are this rank's share of its replica's work."""

    name: str
    model: str
    kind: str  # "generate" | "inference" | "train_step"
    start_seconds: float  # on the master's clock
    end_seconds: float
    tokens: int
    flops: float
    peak_memory_bytes: int


@dataclass(frozen=True)
class MoveRecord:
    """One parameter reallocation (an EMA is one, named ``ema:<model>``) or data transfer a rank took part in."""

    kind: MoveKind
    what: str  # the model reallocated, or the output key transferred
    src: str  # str(Layout)
    dst: str
    num_bytes: int  # sent by this rank
    start_seconds: float  # on the master's clock
    end_seconds: float


@dataclass(frozen=True)
class StatsShare:
    """Statistics of one MFC from one reporting rank per DP replica, weighted by the samples it saw."""

    stats: dict[str, float]
    samples: int


@dataclass(frozen=True)
class Span:
    """When something began and ended on one rank, on the master's clock."""

    start_seconds: float
    end_seconds: float


@dataclass
class StepRecord:
    """What one rank did in one step (sent to the master)."""

    rank: int
    step: int
    step_start_seconds: float = 0.0
    step_end_seconds: float = 0.0
    mfcs: list[MFCRecord] = field(default_factory=list)
    moves: list[MoveRecord] = field(default_factory=list)
    stats: list[StatsShare] = field(default_factory=list)
    # an evaluation after this step (runtime/step/evaluation.py): sums over this rank's held-out prompts
    # (reward, accuracy, length, prompts), when it began and ended on this rank, and the policy version it
    # evaluated (the actor's completed train steps)
    eval_sums: dict[str, float] = field(default_factory=dict)
    eval_span: Span | None = None
    eval_version: int = -1
    # async mode: per producer MFC, the tokens of the batch this step took from the rollout buffer (the batch it
    # trains on; one rank per DP replica reports its share), whenever that batch was generated
    taken_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepDecision:
    """What the master tells every rank after a step (every rank follows it, so they stay in step)."""

    checkpoint: bool
    stop: bool
