"""A scripted environment for the multi-turn evaluation tests (``environment.name: graded_env:Graded``; the runtime
tests put tests/runtime on PYTHONPATH): outcomes that depend on what the policy wrote, without a sandbox."""

from __future__ import annotations

from restage.algorithms.environments import EpisodeContext, StepResult
from restage.algorithms.tools import ToolCall, ToolResult
from restage.data import arith


class Graded:
    """An observation after each of the first two answers, done after the third. A step's reward is 0.1 per word of
    the answer; an answer holding a digit counts as a call that ran, one without as a failed call; the final score
    is the calculator task's score of the last answer."""

    def __init__(self, ctx: EpisodeContext):
        self.ctx, self.turn = ctx, 0
        self.final_score: float | None = None

    def reset(self) -> str:
        return self.ctx.prompt

    def step(self, answer: str) -> StepResult:
        self.turn += 1
        ran = any(c.isdigit() for c in answer)
        result = ToolResult(ToolCall("calculator", {"input": answer}), "ok" if ran else "error", "")
        done = self.turn >= 3
        if done:
            self.final_score = arith.score(self.ctx.prompt, answer)
        return StepResult("<result> 7 </result>", 0.1 * len(answer.split()), done, (result,))
