"""Evaluation during training (run.eval_every) in real two-rank runs: eval rows at exactly the cadence steps (and
the last), every held-out prompt evaluated once, greedy answers deterministic, training untouched by it."""

import math

import pytest
import torch
from runs import hf_weights, restage_run

from restage.config.load import load_config
from restage.data.datasets import load_splits
from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

# The actor generates dp2 and trains tp2: each evaluation reallocates it into its generation layout first.
PPO = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "plan.mode=manual",
       "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0 dp1",
       "plan.layouts.critic_inf=ranks:1 dp1", "plan.layouts.actor_train=ranks:0-1 tp2",
       "plan.layouts.critic_train=ranks:0-1 dp2"]
EVAL = ["run.eval_every=2", "dataset.eval_fraction=0.02"]
EVAL_KEYS = {"eval/reward", "eval/accuracy", "eval/length", "eval/prompts", "eval/seconds", "eval/policy_version"}


def _held_out(*overrides: str) -> int:
    return len(load_splits(load_config("jobs/ppo_tiny.yaml", list(overrides)))[1])


def _eval_steps(log) -> dict[str, list[int]]:
    series = log.stat_series()
    return {name: series[name][0].tolist() for name in series if name.startswith("eval/")}


def test_evaluation_at_the_cadence_and_the_last_step_of_frozen_weights_is_deterministic(tmp_path):
    """A learning rate of 1e-30 leaves the weights as they were (but for embedding entries within 1e-29 of 0): the
    evaluations after steps 2 and 3 see the same weights, so greedy answers, and their reward, must be equal."""
    frozen = ["models.actor.optim.lr=1e-30", "models.critic.optim.lr=1e-30", "run.save_every=1", "run.keep_checkpoints=9"]
    done = restage_run(tmp_path, *PPO, *EVAL, *frozen, "run.steps=3", "trial=frozen", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trial = tmp_path / "ppo-tiny" / "frozen"
    log = read_log(trial)
    assert log.steps["step"].tolist() == [1, 2, 3]  # steps count from 1, as the progress lines and checkpoints do
    assert _eval_steps(log) == dict.fromkeys(EVAL_KEYS, [2, 3])  # every 2nd step, and the last
    series = log.stat_series()
    assert series["eval/prompts"][1].tolist() == [_held_out(*EVAL)] * 2 == [20.0, 20.0]
    assert series["eval/policy_version"][1].tolist() == [2.0, 3.0]  # the weights steps 2 and 3 made
    a, b = (hf_weights(trial / "checkpoints" / f"step-{n}" / "actor" / "hf") for n in (2, 3))
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-25) for k in a)  # the premise: the same weights
    for name in ("eval/reward", "eval/accuracy", "eval/length"):
        first, second = series[name][1].tolist()
        assert first == second, name  # greedy: the same answers
    reward = series["eval/reward"][1][0]
    assert 0.0 <= reward <= 1.0 and 1.0 <= series["eval/length"][1][0] <= 7.0
    lines = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert [("eval/reward" in line) for line in lines] == [False, True, True], lines
    assert f"eval/reward {reward:.4g}" in lines[1]


def test_a_reward_model_scores_the_evaluation_and_training_is_as_without_it(tmp_path):
    """GRPO scored by a reward model on rank 1 (the answers move there from the dp2 generation); the same run
    without evaluation trains bitwise alike, since greedy answers draw no random numbers and move no cursor."""
    job = ["jobs/grpo_tiny.yaml", "-n", "2", "run.steps=2", "reward_fn=", "models.reward.path=results/assets/tiny-llama",
           "models.reward.init_critic_from_lm=true", "dataset.eval_fraction=0.01", "algo.group_size=4",
           "plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.reward_inf=ranks:1 dp1",
           "plan.layouts.ref_inf=ranks:0 dp1", "plan.layouts.actor_train=ranks:0-1 tp2"]
    evaluated = restage_run(tmp_path, *job, "run.eval_every=1", "trial=evaluated", timeout=600)
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    plain = restage_run(tmp_path, *job, "trial=plain", timeout=600)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    with_eval, without = read_log(tmp_path / "grpo-tiny" / "evaluated"), read_log(tmp_path / "grpo-tiny" / "plain")
    assert _eval_steps(with_eval) == dict.fromkeys(EVAL_KEYS - {"eval/accuracy"}, [1, 2])  # a model gives no accuracy
    assert _eval_steps(without) == {}
    series = with_eval.stat_series()
    assert series["eval/prompts"][1].tolist() == [10.0, 10.0]
    assert all(math.isfinite(v) for v in series["eval/reward"][1])
    trained = without.stat_series()
    assert set(trained) == {name for name in series if not name.startswith("eval/")}
    for name, (steps, values) in trained.items():
        assert steps.tolist() == series[name][0].tolist() and values.tolist() == series[name][1].tolist(), name
