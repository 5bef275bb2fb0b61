"""Held-out evaluation in async mode (plan.execution async, run.eval_every) in real two-rank GRPO runs: the actor
generates ahead on rank 1 and trains on rank 0, and each evaluation answers on rank 0 with the weights the step
made (policy version s after step s), the version a sync run evaluates at the same step.

Checked: eval rows at exactly the cadence steps and the last, with their policy version; training bitwise as a run
without evaluation (every statistic, every checkpoint's weights); the evaluation equal to a sync run's evaluation of
the same weights; and a resumed run evaluating at the same steps, with the same results, as an uninterrupted one."""

import numpy as np
import pytest
import torch
from runs import hf_weights, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

STEPS = 5
SPLIT = ["plan.mode=manual", "plan.layouts.actor_gen=ranks:1-1 dp1", "plan.layouts.ref_inf=ranks:0-0 dp1",
         "plan.layouts.actor_train=ranks:0-0 dp1"]
ASYNC = ["jobs/grpo_tiny.yaml", "-n", "2", f"run.steps={STEPS}", "plan.execution=async", *SPLIT,
         "plan.layouts.actor_prox=ranks:0-0 dp1", "dataset.eval_fraction=0.02", "run.keep_checkpoints=9"]
EVAL = ["run.eval_every=2"]
EVAL_KEYS = {"eval/reward", "eval/accuracy", "eval/length", "eval/prompts", "eval/seconds", "eval/policy_version"}
ANSWERS = ("eval/reward", "eval/accuracy", "eval/length", "eval/prompts")  # what the greedy answers decide


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _eval_steps(series) -> dict[str, list[int]]:
    return {name: series[name][0].tolist() for name in series if name.startswith("eval/")}


def _actor(trial, step: int) -> dict[str, torch.Tensor]:
    return hf_weights(trial / "checkpoints" / f"step-{step}" / "actor" / "hf")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """The async run with evaluation after steps 2, 4 and 5, checkpointed after steps 2, 4 and 5."""
    results = tmp_path_factory.mktemp("evaluated")
    _ok(restage_run(results, *ASYNC, *EVAL, "run.save_every=2", "trial=evaluated"))
    return results / "grpo-tiny" / "evaluated"


def test_async_evaluation_runs_at_the_cadence_and_training_is_bitwise_as_without_it(tmp_path, evaluated):
    _ok(restage_run(tmp_path, *ASYNC, "run.save_every=2", "trial=plain"))
    with_eval, without = read_log(evaluated).stat_series(), read_log(tmp_path / "grpo-tiny" / "plain").stat_series()
    assert _eval_steps(with_eval) == dict.fromkeys(EVAL_KEYS, [2, 4, 5])  # every 2nd step, and the last
    assert with_eval["eval/policy_version"][1].tolist() == [2.0, 4.0, 5.0]  # the weights the step made
    assert with_eval["eval/prompts"][1].tolist() == [20.0] * 3
    assert _eval_steps(without) == {}
    # Training untouched: every statistic (losses, rewards, version gaps, the buffer's occupancy) bit for bit,
    # and the weights at every checkpoint; the generation rank's batches are the same (behaviour versions too).
    assert set(without) == {name for name in with_eval if not name.startswith("eval/")}
    assert "actor_gen/behaviour_version" in without and "actor_train/version_gap_max" in without
    for name, (steps, values) in without.items():
        assert steps.tolist() == with_eval[name][0].tolist(), name
        np.testing.assert_array_equal(values, with_eval[name][1], err_msg=name)
    for step in (2, 4, 5):
        a, b = _actor(evaluated, step), _actor(tmp_path / "grpo-tiny" / "plain", step)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), step


def test_async_evaluation_equals_a_sync_evaluation_of_the_same_weights(tmp_path, evaluated):
    """A sync run started from the async run's step-2 weights, at a learning rate of 1e-30 (which leaves them as
    they were but for entries within 1e-29 of 0), evaluates after its first step what the async run evaluated
    after step 2, in the same layout (one rank, dp1, the same passes): the same greedy answers, so the same scores."""
    start = evaluated / "checkpoints" / "step-2" / "actor" / "hf"
    sync = ["jobs/grpo_tiny.yaml", "-n", "2", "run.steps=1", *SPLIT, "dataset.eval_fraction=0.02", "run.eval_every=1",
            f"models.actor.path={start}", "models.actor.optim.lr=1e-30", "trial=sync"]
    _ok(restage_run(tmp_path, *sync))
    trial = tmp_path / "grpo-tiny" / "sync"
    a, b = _actor(evaluated, 2), _actor(trial, 1)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-25) for k in a)  # the premise
    asynchronous, synchronous = read_log(evaluated).stat_series(), read_log(trial).stat_series()
    assert asynchronous["eval/policy_version"][1][0] == 2.0 and synchronous["eval/policy_version"][1].tolist() == [1.0]
    for name in ANSWERS:
        assert synchronous[name][0].tolist() == [1], name
        assert asynchronous[name][0][0] == 2 and synchronous[name][1][0] == asynchronous[name][1][0], name
    # The evaluated version matters: the async run's later evaluations (other weights) score differently.
    assert len(set(asynchronous["eval/reward"][1].tolist())) == 3


def test_a_resumed_async_run_evaluates_at_the_same_steps_with_the_same_results(tmp_path, evaluated):
    """Stopped after step 3 (run.stop_at_step checkpoints and stops), resumed with --resume: evaluations after steps
    2, 4 and 5 equal the uninterrupted run's, as does everything it trained (push_every 1: a resume is bitwise)."""
    _ok(restage_run(tmp_path, *ASYNC, *EVAL, "run.stop_at_step=3", "trial=resumed"))
    trial = tmp_path / "grpo-tiny" / "resumed"
    stopped = read_log(trial)
    assert stopped.last_complete_step == 3 and _eval_steps(stopped.stat_series()) == dict.fromkeys(EVAL_KEYS, [2])
    _ok(restage_run(tmp_path, "jobs/grpo_tiny.yaml", "-n", "2", "trial=resumed", "--resume"))
    straight, resumed = read_log(evaluated), read_log(trial)
    assert resumed.resumed_at_steps == [3] and resumed.last_complete_step == STEPS
    series_a, series_b = straight.stat_series(), resumed.stat_series()
    assert _eval_steps(series_b) == dict.fromkeys(EVAL_KEYS, [2, 4, 5])
    assert series_a.keys() == series_b.keys()
    for name in series_a:
        if name != "eval/seconds":  # a duration
            np.testing.assert_array_equal(series_a[name][0], series_b[name][0], err_msg=name)
            np.testing.assert_array_equal(series_a[name][1], series_b[name][1], err_msg=name)
    a, b = _actor(evaluated, STEPS), _actor(trial, STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.scale  # about 32 s: make test's time bound
def test_a_reward_model_on_the_generation_rank_scores_the_async_evaluation(tmp_path):
    """The reward model scores on rank 1 (beside generation): each evaluation's answers move there from the training
    rank by the evaluation's own transfers, and training is still bitwise as without evaluation."""
    job = ["jobs/grpo_tiny.yaml", "-n", "2", "run.steps=2", "plan.execution=async", *SPLIT,
           "plan.layouts.actor_prox=ranks:0-0 dp1", "plan.layouts.reward_inf=ranks:1-1 dp1", "reward_fn=",
           "models.reward.path=results/assets/tiny-llama", "models.reward.init_critic_from_lm=true",
           "dataset.eval_fraction=0.01", "algo.group_size=4"]
    _ok(restage_run(tmp_path, *job, "run.eval_every=1", "trial=evaluated"))
    _ok(restage_run(tmp_path, *job, "trial=plain"))
    with_eval = read_log(tmp_path / "grpo-tiny" / "evaluated").stat_series()
    without = read_log(tmp_path / "grpo-tiny" / "plain").stat_series()
    assert _eval_steps(with_eval) == dict.fromkeys(EVAL_KEYS - {"eval/accuracy"}, [1, 2])  # a model gives no accuracy
    assert with_eval["eval/prompts"][1].tolist() == [10.0, 10.0]
    assert with_eval["eval/policy_version"][1].tolist() == [1.0, 2.0]
    assert np.isfinite(with_eval["eval/reward"][1]).all()
    assert set(without) == {name for name in with_eval if not name.startswith("eval/")}
    for name, (steps, values) in without.items():
        assert steps.tolist() == with_eval[name][0].tolist(), name
        np.testing.assert_array_equal(values, with_eval[name][1], err_msg=name)
