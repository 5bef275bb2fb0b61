"""The calculator task (jobs/grpo_calculator_tiny.yaml) learns to call its tool under `restage run` (issue 31).

From the random policy, multi-turn GRPO on one rank: the tiny policy starts almost never writing a call that runs;
the tool-call rate (``actor_gen/tool_call_rate``: episodes with a call that ran) and the final answers' score
(``actor_gen/final_score``, the mean of ``restage.data.arith:reward``) are read from log.h5 over the first and the
last five steps. Its exact accuracy stays 0 (docs/algorithms.md, "Multi-turn episodes").

From the SFT warm start (jobs/sft_calculator_tiny.yaml), GRPO raises the exact accuracy on the held-out prompts
(``bench/multi_turn_eval.py``, the last 64 prompts, one episode per prompt and seed, 4 seeds), the tool-call rate
kept. Marked ``scale`` (``make test-scale``): each takes 3.5-12 minutes on 2 shared CPU cores (3.5 and 7.4 min at the last runs).
"""

import pytest
from e2e_jobs import ROOT, report, restage_run

pytestmark = [pytest.mark.e2e, pytest.mark.scale]

STEPS, WINDOW = 80, 5
RL_STEPS, SEEDS = 150, (7, 8, 9, 10)


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


def test_multi_turn_tool_call_accuracy_rises_under_rl_after_an_sft_warm_start(tmp_path, bench_module):
    from restage.demo import ensure_arith_model

    ensure_arith_model(ROOT)
    evaluate = bench_module("multi_turn_eval").evaluate
    sft = restage_run(tmp_path, "sft_calculator_tiny", 1, "e2e", timeout=1200)
    start = sft.checkpoint("actor")
    rl = restage_run(tmp_path, "grpo_calculator_tiny", 1, "from-sft", f"models.actor.path={start}",
                     "models.actor.optim.lr=1e-3", f"run.steps={RL_STEPS}", timeout=3000)
    job = str(ROOT / "jobs" / "grpo_calculator_tiny.yaml")
    before, after = evaluate(str(start), job, seeds=SEEDS), evaluate(str(rl.checkpoint("actor")), job, seeds=SEEDS)
    report("multi_turn_sft_then_rl", rl_steps=RL_STEPS, episodes=after["episodes"],
           tool_call_rate_sft=before["tool_call_rate"], accuracy_sft=before["accuracy"],
           tool_call_rate_rl=after["tool_call_rate"], accuracy_rl=after["accuracy"], sft_seconds=sft.seconds,
           rl_seconds=rl.seconds)
    # Measured (256 episodes each): SFT tool-call rate 0.969, accuracy 0.047; after 150 RL steps 0.984, 0.184 and, in
    # this test (7.4 min), 0.996, 0.148 (RL runs are not bitwise repeatable); the bar is under the smaller gain's 2/3.
    assert before["tool_call_rate"] >= 0.9 and before["accuracy"] <= 0.1, before
    assert after["tool_call_rate"] >= 0.9 and after["accuracy"] - before["accuracy"] >= 0.06, (before, after)
