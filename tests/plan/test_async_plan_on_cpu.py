"""Async mode in planning: the steady state the simulator predicts, and plan.execution auto's choice."""

from pathlib import Path

import pytest

from restage.config.load import load_config
from restage.demo import ensure_tiny_model
from restage.errors import ConfigError
from restage.plan.async_plan import best_async_plan, splits
from restage.plan.cli import mode_line, render
from restage.plan.plan_score import evaluate
from restage.plan.planner import build_problem, make_plan
from restage.plan.schedule import build_schedule
from restage.plan.simulator import op_seconds, plan_program, refill_seconds
from restage.schedule.ops import Generate, Push, Run, SendKey

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "jobs" / "grpo_tiny.yaml"


@pytest.fixture(autouse=True, scope="module")
def tiny_model():
    """The job's model directory (results/assets/tiny-llama), built as `make demo` builds it: a fresh clone has none."""
    ensure_tiny_model(ROOT)


def async_problem(staleness=1, push_every=1, steps=60):
    cfg = load_config(JOB, ["plan.execution=async", f"plan.staleness={staleness}", f"plan.push_every={push_every}",
                            f"run.steps={steps}"])
    return build_problem(cfg)


def test_steady_state_is_the_slower_side_plus_push_transfers_and_spread_warmup():
    problem = async_problem(steps=40)
    assert splits(problem) == [((0, 1), (1, 1))]  # 2 CPU ranks: training on rank 0, generation on rank 1
    plan, ev = best_async_plan(problem)
    program = plan_program(problem, plan)
    seconds = {type(op).__name__ + (op.mfc if isinstance(op, Run | Generate) else ""): s for op, s in program
               if not isinstance(op, SendKey)}
    push = sum(s for op, s in program if isinstance(op, Push))
    sends = sum(s for op, s in program if isinstance(op, SendKey) and op.producer == "actor_gen")
    gen = plan[problem.index["actor_gen"]].seconds
    train_side = sum(s for op, s in program if isinstance(op, Run))
    assert seconds["Generateactor_gen"] == gen and push > 0 and sends > 0
    makespan = push + sends + max(gen, train_side)  # the consumers' own transfers stay on rank 0 (0 s)
    assert ev.timeline.makespan_seconds == pytest.approx(makespan, rel=1e-12)
    assert ev.iteration_seconds == pytest.approx(makespan + gen / 40, rel=1e-12)  # one batch of warm-up over 40 steps
    assert ev.timeline.makespan_seconds < push + sends + gen + train_side  # generation overlaps training


def test_pushing_every_second_step_halves_the_push_and_doubles_nothing_else():
    one, two = async_problem(2, 1), async_problem(2, 2)
    plan_one, ev_one = best_async_plan(one)
    plan_two, ev_two = best_async_plan(two)
    push_one = next(op for op, _ in plan_program(one, plan_one) if isinstance(op, Push))
    push_two = next(op for op, _ in plan_program(two, plan_two) if isinstance(op, Push))
    assert op_seconds(two, plan_two, push_two) == pytest.approx(op_seconds(one, plan_one, push_one) / 2, rel=1e-12)
    # staleness 2 pushing every step generates two batches ahead (warm-up of two), every second step one
    gen = plan_one[one.index["actor_gen"]].seconds
    assert ev_one.iteration_seconds - ev_one.timeline.makespan_seconds == pytest.approx(2 * gen / 60, rel=1e-12)


def test_auto_plans_both_modes_and_runs_the_faster():
    cfg = load_config(JOB, ["plan.execution=auto"])
    outcome = make_plan(cfg, with_baselines=False)
    choice = outcome.mode_choice
    sync = make_plan(load_config(JOB), with_baselines=False)
    assert choice.sync_samples_per_second == pytest.approx(8 / sync.evaluation.iteration_seconds, rel=1e-12)
    rates = []
    for staleness, push_every in ((1, 1), (2, 1), (2, 2)):
        problem = async_problem(staleness, push_every)
        rates.append((8 / best_async_plan(problem)[1].iteration_seconds, staleness, push_every))
    best = max(rates, key=lambda r: r[0])
    assert choice.async_samples_per_second == pytest.approx(best[0], rel=1e-12)
    assert (choice.staleness, choice.push_every) == best[1:]
    assert choice.chosen == ("async" if best[0] > choice.sync_samples_per_second else "sync")
    schedule = build_schedule(cfg, outcome)
    assert schedule.config["plan"]["execution"] == choice.chosen  # the ranks run the chosen mode
    assert schedule.plan.mode_choice.chosen == choice.chosen
    line = mode_line(choice)
    assert line.startswith(f"execution: {choice.chosen} chosen") and f"{choice.sync_samples_per_second:.2f}" in line
    assert f"{choice.async_samples_per_second:.2f}" in line


def test_auto_with_evaluation_weighs_the_same_async_plans():
    """Held-out evaluation runs in both modes (runtime/step/evaluation.py) and is costed in neither: auto's candidates and
    figures are those of the run without it (it once left async out whenever run.eval_every was set)."""
    plain = make_plan(load_config(JOB, ["plan.execution=auto"]), with_baselines=False).mode_choice
    evaluated = make_plan(load_config(JOB, ["plan.execution=auto", "run.eval_every=10", "dataset.eval_fraction=0.02"]),
                          with_baselines=False).mode_choice
    assert evaluated.async_samples_per_second is not None
    assert evaluated == plain


def test_async_schedule_of_the_search_runs_generation_apart():
    outcome = make_plan(load_config(JOB, ["plan.execution=async"]), with_baselines=False)
    layouts = {c.mfc: c.layout for c in outcome.plan}
    assert layouts["actor_gen"].mesh == (1,) and {layouts[m].mesh for m in layouts if m != "actor_gen"} == {(0,)}
    assert outcome.evaluation.iteration_seconds == evaluate(outcome.problem, outcome.plan).iteration_seconds


def test_auto_with_manual_layouts_is_refused():
    with pytest.raises(Exception, match="plan.execution auto chooses the layouts"):
        make_plan(load_config(JOB, ["plan.execution=auto", "plan.mode=manual"]), with_baselines=False)


def test_partial_rollouts_cost_the_refill_and_one_batch_less_of_warm_up():
    """Partial rollouts at (k, n) = (2, 1): generation runs k - n = 1 step ahead (one warm-up batch, not two), and
    each step's generate adds the prefill again of the answers left in flight (refill_seconds: every answer of the
    batch, prompt + gen / 2 tokens, scaled from the candidate's prefill of prompt - 1 tokens once per group)."""
    whole = async_problem(2, 1, steps=40)
    cfg = load_config(JOB, ["plan.execution=async", "plan.staleness=2", "plan.push_every=1",
                            "plan.partial_rollouts=true", "run.steps=40"])
    partial = build_problem(cfg)
    plan, ev = best_async_plan(partial)
    gen_op = next(op for op, _ in plan_program(partial, plan) if isinstance(op, Generate) and op.start == 1)
    assert gen_op.partial and gen_op.stop == 2
    candidate = plan[partial.index["actor_gen"]]
    mfc = partial.graph["actor_gen"]
    group, prompt, answer = 8, mfc.prompt_tokens, mfc.gen_tokens
    refill = candidate.estimate.part("prefill_seconds") * group * (prompt + answer / 2) / (prompt - 1)
    assert refill > 0 and refill_seconds(mfc, candidate) == pytest.approx(refill, rel=1e-12)
    assert op_seconds(partial, plan, gen_op) == pytest.approx(candidate.seconds + refill, rel=1e-12)
    assert ev.iteration_seconds - ev.timeline.makespan_seconds == pytest.approx(candidate.seconds / 40, rel=1e-12)
    plan_whole, ev_whole = best_async_plan(whole)
    assert ev_whole.iteration_seconds - ev_whole.timeline.makespan_seconds == pytest.approx(
        2 * plan_whole[whole.index["actor_gen"]].seconds / 40, rel=1e-12)


def test_restage_plan_names_partial_rollouts():
    cfg = load_config(JOB, ["plan.execution=async", "plan.staleness=2", "plan.partial_rollouts=true"])
    outcome = make_plan(cfg, with_baselines=False)
    text = render(build_schedule(cfg, outcome), outcome)
    assert "execution: async (staleness 2, push every 1, partial rollouts)" in text.splitlines()
    whole = load_config(JOB, ["plan.execution=async", "plan.staleness=2"])
    outcome = make_plan(whole, with_baselines=False)
    assert "execution: async (staleness 2, push every 1)" in render(build_schedule(whole, outcome), outcome).splitlines()


def test_auto_tries_partial_rollouts_only_when_allowed():
    outcome = make_plan(load_config(JOB, ["plan.execution=auto", "plan.partial_rollouts=true"]), with_baselines=False)
    plain = make_plan(load_config(JOB, ["plan.execution=auto"]), with_baselines=False)
    # Every answer costed at one length: no tail for partial rollouts to save, so (2, 1) partial costs the refill
    # more than (1, 1) whole at the same lookahead, and the choice is the one without the key.
    assert outcome.mode_choice == plain.mode_choice and not outcome.mode_choice.partial
    assert "partial" not in mode_line(outcome.mode_choice)
    with pytest.raises(ConfigError, match="plan.staleness >= plan.push_every \\+ 1"):
        load_config(JOB, ["plan.execution=async", "plan.partial_rollouts=true"])
    with pytest.raises(ConfigError, match="plan.execution=async"):
        load_config(JOB, ["plan.partial_rollouts=true"])
