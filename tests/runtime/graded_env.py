"""A scripted environment for the multi-turn evaluation tests (``environment.name: graded_env:Graded``; the runtime
tests put tests/runtime on PYTHONPATH): outcomes that depend on what the policy wrote, without a sandbox."""

from __future__ import annotations

import os
import time
from pathlib import Path

from restage.algorithms.environments import EpisodeContext, StepResult
from restage.algorithms.tools import ToolCall, ToolResult
from restage.data import arith


class Graded:
    """An observation after each of the first two answers, done after the third. A step's reward is 0.1 per word of
    the answer; an answer holding a digit counts as a call that ran, one without as a failed call; the final score
    is the calculator task's score of the last answer.

    With ``GRADED_HANG_AFTER=<path>`` and ``GRADED_HANG_MARK=<dir>`` set, an episode's second step, once ``path``
    exists (a checkpoint, say), marks ``dir`` and sleeps: the run is caught in the middle of its episodes."""

    def __init__(self, ctx: EpisodeContext):
        self.ctx, self.turn = ctx, 0
        self.final_score: float | None = None

    def reset(self) -> str:
        return self.ctx.prompt

    def step(self, answer: str) -> StepResult:
        after, mark = os.environ.get("GRADED_HANG_AFTER"), os.environ.get("GRADED_HANG_MARK")
        if self.turn == 1 and after and mark and Path(after).exists():
            (Path(mark) / f"sample-{self.ctx.sample_id}").touch()
            time.sleep(3600)
        self.turn += 1
        ran = any(c.isdigit() for c in answer)
        result = ToolResult(ToolCall("calculator", {"input": answer}), "ok" if ran else "error", "")
        done = self.turn >= 3
        if done:
            self.final_score = arith.score(self.ctx.prompt, answer)
        return StepResult("<result> 7 </result>", 0.1 * len(answer.split()), done, (result,))
