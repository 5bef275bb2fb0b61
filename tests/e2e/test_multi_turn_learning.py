"""The calculator task (jobs/grpo_calculator_tiny.yaml) learns to call its tool under `restage run` (issue 31).

Multi-turn GRPO on one rank: the tiny policy starts almost never writing a call that runs; the tool-call rate
(``actor_gen/tool_call_rate``: episodes with a call that ran) and the final answers' score (``actor_gen/final_score``,
the mean of ``restage.data.arith:reward``) are read from log.h5 over the first and the last five steps. Marked
``scale`` (``make test-scale``): 80 steps take about 10 minutes on 2 loaded CPU cores.
"""

import pytest
from e2e_jobs import ROOT, report, restage_run

pytestmark = [pytest.mark.e2e, pytest.mark.scale]

STEPS, WINDOW = 80, 5


def test_multi_turn_calculator_task_learns_to_call_its_tool(tmp_path):
    from restage.demo import ensure_arith_model

    ensure_arith_model(ROOT)
    run = restage_run(tmp_path, "grpo_calculator_tiny", 1, "e2e", f"run.steps={STEPS}", timeout=3000)
    rate, score = run.stat("actor_gen/tool_call_rate"), run.stat("actor_gen/final_score")
    start, end = float(rate[:WINDOW].mean()), float(rate[-WINDOW:].mean())
    assert start <= 0.1 and end - start >= 0.5, f"tool-call rate {start:.3f} -> {end:.3f} in {STEPS} steps"
    report("multi_turn_calculator", steps=STEPS, tool_call_rate_start=start, tool_call_rate_end=end,
           final_score_start=float(score[:WINDOW].mean()), final_score_end=float(score[-WINDOW:].mean()),
           seconds=run.seconds)
