"""Partial rollouts (`plan.partial_rollouts`) under `restage run -n 2`: the actor generates on rank 1, trains on rank 0,
and the answers still being written when new weights land continue under them.

With staleness k = 2 and push_every n = 1 generation runs k - n = 1 step ahead: the generate of step s finishes
batch s + 1 (begun at step s - 1) and begins batch s + 2. A token of the batch trained at step t >= 2 was written
at step t - 2 (version t - 2) or t - 1 (version t - 1): every gap is 1 or 2, and the samples that span two
versions are exactly those cut mid-answer at step t - 2.
"""

import numpy as np
import pytest
from e2e_jobs import ASYNC_SPLIT as SPLIT
from e2e_jobs import GRPO_MFCS, PPO_MFCS, REMAX_MFCS, layout_overrides, report, restage_run

from restage.schedule.async_program import lookahead

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

STALENESS, PUSH_EVERY = 2, 1


def partial_overrides(staleness: int = STALENESS, push_every: int = PUSH_EVERY, mfcs=GRPO_MFCS) -> list[str]:
    return ["plan.execution=async", f"plan.staleness={staleness}", f"plan.push_every={push_every}",
            "plan.partial_rollouts=true", *layout_overrides(SPLIT, mfcs)]


def pushed(step: int, push_every: int) -> int:
    """The version the generation copy holds at step ``step``: that of the last push (every push_every-th step)."""
    return step - step % push_every


@pytest.mark.parametrize("job, mfcs, staleness, push_every, steps", [
    # two of the four in make test-scale only (make test's time bound)
    pytest.param("grpo_tiny", GRPO_MFCS, 2, 1, 8, marks=pytest.mark.scale), ("grpo_tiny", GRPO_MFCS, 3, 2, 9),
    pytest.param("ppo_tiny", PPO_MFCS, 2, 1, 6, marks=pytest.mark.scale),
    ("remax_tiny", REMAX_MFCS, 2, 1, 6),  # two producers: sampled answers and the greedy baseline
])
def test_tokens_span_two_versions_within_the_bound(tmp_path, job, mfcs, staleness, push_every, steps):
    run = restage_run(tmp_path, job, 2, "partial", f"run.steps={steps}", *partial_overrides(staleness, push_every, mfcs))
    ahead = lookahead(staleness, push_every, partial=True)
    assert ahead == staleness - push_every == 1
    # Logged at the generate of step s (batch s + 1 finished, batch s + 2 begun): the fraction of batch s + 2's
    # samples cut mid-answer, and its tokens written so far per sample. The last two steps begin nothing.
    cut_samples, cut_tokens = run.stat("actor_gen/cut_samples"), run.stat("actor_gen/cut_tokens")
    answer_tokens = run.stat("actor_gen/answer_tokens")  # per sample of the batch finished at step s
    assert len(cut_samples) == steps - 1 and cut_samples[-1] == 0 and cut_tokens[-1] == 0
    assert (cut_samples[:-1] > 0).all()  # every batch but the last is begun early, and some answers cut
    # Batch t >= 2 was begun at step t - 2 (the copy's version pushed(t - 2)) and finished at step t - 1: its
    # samples span two versions exactly when they were cut and a push came between.
    begun = {t: pushed(t - 2, push_every) for t in range(2, steps)}
    finished = {t: pushed(t - 1, push_every) for t in range(2, steps)}
    mixed = [0.0, 0.0] + [cut_samples[t - 2] if begun[t] != finished[t] else 0.0 for t in range(2, steps)]
    np.testing.assert_array_equal(run.stat("actor_gen/mixed_version_samples"), mixed)
    assert sum(m > 0 for m in mixed) == sum(begun[t] != finished[t] for t in begun)
    # The batch's oldest token: the begun version where step t - 2 wrote any of it (warm-up and batch 1: 0).
    expected = [0.0, 0.0] + [float(begun[t] if cut_tokens[t - 2] > 0 else finished[t]) for t in range(2, steps)]
    np.testing.assert_array_equal(run.stat("actor_gen/behaviour_version"), expected)

    gap = {g: run.stat(f"actor_train/version_gap_{g}") for g in range(staleness + 1)}
    np.testing.assert_array_equal(gap[0][:2], [1.0, 0.0])  # batch 0: warm-up, trained at 0; batch 1: made at step 0
    np.testing.assert_array_equal(gap[1][:2], [0.0, 1.0])
    np.testing.assert_allclose(sum(gap.values()), 1.0, rtol=0, atol=1e-12)  # no token past the bound
    assert (run.stat("actor_train/version_gap_max") <= staleness).all()
    for t in range(2, steps):
        old, new = t - begun[t], t - finished[t]  # the two gaps batch t's tokens may have
        assert max(old, new) <= staleness and all(gap[g][t] == 0 for g in gap if g not in (old, new)), t
        if old != new:  # tokens at the older gap are those written at step t - 2: per token, over 2 micro-batches
            np.testing.assert_allclose(gap[old][t], cut_tokens[t - 2] / answer_tokens[t - 1], rtol=0, atol=0.03)
            assert gap[old][t] > 0
    assert max(t - begun[t] for t in begun) == staleness  # the worst gap reaches the bound
    if "actor_greedy_gen" in mfcs:  # the baseline's answers follow the same rule (versions not trained on)
        greedy_cut = run.stat("actor_greedy_gen/cut_tokens")
        expected = [0.0, 0.0] + [float(begun[t] if greedy_cut[t - 2] > 0 else finished[t]) for t in range(2, steps)]
        np.testing.assert_array_equal(run.stat("actor_greedy_gen/behaviour_version"), expected)


WINDOW = 5  # steps averaged at each end of the reward curve, as tests/e2e/test_async_rl.py


def test_async_grpo_with_partial_rollouts_raises_reward_by_the_sync_margin(tmp_path):
    steps, margin = 50, 0.10
    run = restage_run(tmp_path, "grpo_tiny", 2, "partial", f"run.steps={steps}", *partial_overrides())
    reward = run.stat("actor_train/reward")
    start, end = float(reward[:WINDOW].mean()), float(reward[-WINDOW:].mean())
    assert end - start >= margin, f"partial-rollout grpo reward {start:.3f} -> {end:.3f} in {steps} steps"
    assert (run.stat("actor_train/version_gap_max") <= STALENESS).all()
    report("async grpo, partial rollouts", steps=steps, reward_start=start, reward_end=end, gain=end - start,
           mixed=float(run.stat("actor_gen/mixed_version_samples").mean()), seconds=run.seconds)


def test_multi_turn_partial_rollouts_carry_episodes_within_the_bound(tmp_path):
    """Multi-turn episodes (the calculator job's tool calls) under partial rollouts: batch s + 2's episodes begun at
    step s are finished at step s + 1 (``runtime/step/partial_episodes.py``); their tokens span the two versions and stay
    within the staleness bound."""
    from e2e_jobs import ROOT

    from restage.demo import ensure_arith_model

    ensure_arith_model(ROOT)
    steps = 4
    run = restage_run(tmp_path, "grpo_calculator_tiny", 2, "partial", f"run.steps={steps}", "run.batch_size=4",
                      "algo.group_size=4", "dataset.eval_fraction=0",
                      *partial_overrides(mfcs=("actor_gen", "actor_prox", "actor_train")))
    cut_samples, cut_tokens = run.stat("actor_gen/cut_samples"), run.stat("actor_gen/cut_tokens")
    assert len(cut_samples) == steps - 1 and cut_samples[-1] == 0 and cut_tokens[-1] == 0
    assert (cut_tokens[:-1] > 0).all()  # every batch but the last is begun a step early
    # Batch t >= 2 was begun at step t - 2 and finished at step t - 1 (a push every step): its oldest token is
    # t - 2 where step t - 2 wrote any of it, and only episodes begun then span two versions.
    expected = [0.0, 0.0] + [float(t - 2 if cut_tokens[t - 2] > 0 else t - 1) for t in range(2, steps)]
    np.testing.assert_array_equal(run.stat("actor_gen/behaviour_version"), expected)
    mixed = run.stat("actor_gen/mixed_version_samples")
    assert (mixed[:2] == 0).all() and (mixed[2:] <= cut_samples[:steps - 2] + 1e-9).all()
    gap = {g: run.stat(f"actor_train/version_gap_{g}") for g in range(STALENESS + 1)}
    np.testing.assert_allclose(sum(gap.values()), 1.0, rtol=0, atol=1e-12)  # no answer token past the bound
    assert (run.stat("actor_train/version_gap_max") <= STALENESS).all()
    assert (run.stat("actor_gen/turns") >= 1).all()
