"""Checkpoint before the allocation ends: the master's rule, from measured step and checkpoint times.

SLURM's pre-timeout signal comes ``slurm.signal_delay_seconds`` before the limit and the ranks can only save at
a step's end, so a step plus a save longer than that delay (minutes on GPUs) used to lose the whole attempt. The
job driver instead hands every rank the attempt's end time (``$RESTAGE_DEADLINE``, seconds since the epoch; a
requeued job gets a new one), and at every step boundary the master asks: does the time left cover one more step,
the checkpoint after it and a margin? If not, it checkpoints now and stops, as on ``PREEMPT``, and writes
``<trial>/TIME_LIMIT`` so that the driver requeues the job to resume from that checkpoint (docs/slurm.md,
"Preemption and time limits").

Estimates: the next step is the longest of the last ``WINDOW_STEPS`` steps of this attempt (the first one with
its warm-up included, so the rule errs early); the save is the longest save of this attempt, and until one has
been timed the longer of the step estimate and this attempt's checkpoint load. ``run.save_before_end_seconds`` > 0
replaces the estimates: checkpoint and stop at the first boundary with less than that left.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEADLINE_ENV = "RESTAGE_DEADLINE"
TIME_LIMIT_FILE = "TIME_LIMIT"
# After the last checkpoint: close the log, every rank exits, the driver records the attempt and requeues
# (the driver's own last resort comes 8 s before the limit: launch/job.py).
MARGIN_SECONDS = 15.0
WINDOW_STEPS = 5


def deadline_from_env(env: Mapping[str, str] = os.environ) -> float | None:
    """The attempt's end (seconds since the epoch) the driver passed, or None (no limit known)."""
    raw = env.get(DEADLINE_ENV, "").strip()
    return float(raw) if raw else None


@dataclass(frozen=True)
class StopBeforeDeadline:
    """Why the master checkpoints and stops at a boundary: the numbers the rule compared."""

    seconds_left: float
    next_step_seconds: float
    save_seconds: float
    margin_seconds: float
    by_config: bool = False  # run.save_before_end_seconds (the margin) instead of the estimates

    def describe(self) -> str:
        if self.by_config:
            return (f"{self.seconds_left:.0f} s left before the time limit < "
                    f"run.save_before_end_seconds={self.margin_seconds:g}")
        return (f"{self.seconds_left:.0f} s left before the time limit < next step {self.next_step_seconds:.1f} s + "
                f"checkpoint {self.save_seconds:.1f} s + margin {self.margin_seconds:.0f} s")


def must_stop(seconds_left: float, next_step_seconds: float, save_seconds: float, margin_seconds: float) -> bool:
    """The rule: stop at this boundary unless one more step and the checkpoint after it end a margin before the end."""
    return seconds_left < next_step_seconds + save_seconds + margin_seconds


class DeadlineWatch:
    """The master's measurements of this attempt and its decision at each step boundary."""

    def __init__(self, deadline_seconds: float | None, save_before_end_seconds: float = 0.0,
                 margin_seconds: float = MARGIN_SECONDS):
        self.deadline_seconds = deadline_seconds
        self.save_before_end_seconds = save_before_end_seconds
        self.margin_seconds = margin_seconds
        self.steps: deque[float] = deque(maxlen=WINDOW_STEPS)
        self.saves: list[float] = []
        self.load_seconds = 0.0

    def step_done(self, seconds: float) -> None:
        self.steps.append(seconds)

    def saved(self, seconds: float) -> None:
        self.saves.append(seconds)

    def loaded(self, seconds: float) -> None:
        self.load_seconds = seconds

    @property
    def next_step_seconds(self) -> float:
        return max(self.steps, default=0.0)

    @property
    def save_seconds(self) -> float:
        return max(self.saves) if self.saves else max(self.next_step_seconds, self.load_seconds)

    def check(self, now_seconds: float) -> StopBeforeDeadline | None:
        """At a step boundary (``now_seconds`` since the epoch): the reason to checkpoint and stop now, or None."""
        if self.deadline_seconds is None:
            return None
        left = self.deadline_seconds - now_seconds
        if self.save_before_end_seconds > 0:
            stop = StopBeforeDeadline(left, 0.0, 0.0, self.save_before_end_seconds, by_config=True)
        else:
            stop = StopBeforeDeadline(left, self.next_step_seconds, self.save_seconds, self.margin_seconds)
        return stop if must_stop(stop.seconds_left, stop.next_step_seconds, stop.save_seconds,
                                 stop.margin_seconds) else None


def write_time_limit(trial_dir: Path, step: int, stop: StopBeforeDeadline) -> None:
    """Tell the driver the ranks stop at checkpoint ``step-{step}`` for the time limit (it requeues the job)."""
    record = {"step": step, "seconds_left": round(stop.seconds_left, 3), "reason": stop.describe()}
    (trial_dir / TIME_LIMIT_FILE).write_text(json.dumps(record) + "\n")


def read_time_limit(trial_dir: Path) -> dict[str, Any] | None:
    """What ``write_time_limit`` wrote (step, seconds_left, reason), or None when the ranks did not stop for it."""
    path = trial_dir / TIME_LIMIT_FILE
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record
