"""The calculator task's environment (``environment.name: arith_tools``, jobs/grpo_calculator_tiny.yaml).

``tool_use_spelled`` whose call shaping pays for the call's expression: a call that ran earns
``tool_call_reward`` times ``0.25 + 0.75 x`` the fraction of the prompt's expression it wrote in place
(``7 * 4 8`` for ``compute 7 * 4 8 :``, compared character by character, spaces dropped), the best call of the
step, once per episode. A call that runs whatever its expression (``<call> 3 </call>``) earns a quarter.
"""

from __future__ import annotations

from restage.algorithms.environments import SpelledToolUse
from restage.algorithms.tools import ToolResult
from restage.data import arith


def expression(prompt: str) -> str:
    """The prompt's expression without spaces (``7*48``); '' for another prompt."""
    words = prompt.split()
    if arith.TASK_WORD not in words or arith.END_OF_PROMPT not in words:
        return ""
    return "".join(words[words.index(arith.TASK_WORD) + 1:words.index(arith.END_OF_PROMPT)])


class ArithTools(SpelledToolUse):
    def call_credit(self, results: tuple[ToolResult, ...]) -> float:
        want = expression(self.ctx.prompt)
        best = 0.0
        for r in results:
            if r.status != "ok":
                continue
            got = str(r.call.arguments.get("input", r.call.arguments.get("expression", ""))).replace(" ", "")
            match = sum(a == b for a, b in zip(want, got)) / max(len(want), len(got), 1)
            best = max(best, 0.25 + 0.75 * match)
        return best
