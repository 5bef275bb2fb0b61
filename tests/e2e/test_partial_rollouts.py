"""Partial rollouts (`plan.partial_rollouts`) under `restage run -n 2`: the actor generates on rank 1, trains on rank 0,
and the answers still being written when new weights land continue under them.

With staleness k = 2 and push_every n = 1 generation runs k - n = 1 step ahead: the generate of step s finishes
batch s + 1 (begun at step s - 1) and begins batch s + 2. A token of the batch trained at step t >= 2 was written
at step t - 2 (version t - 2) or t - 1 (version t - 1): every gap is 1 or 2, and the samples that span two
versions are exactly those cut mid-answer at step t - 2.
"""

import numpy as np
import pytest
from e2e_jobs import layout_overrides, report, restage_run

from restage.schedule.async_program import lookahead

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

SPLIT = {"actor_gen": "ranks:1-1 dp1", "ref_inf": "ranks:0-0 dp1", "actor_prox": "ranks:0-0 dp1",
         "actor_train": "ranks:0-0 dp1"}
GRPO_MFCS = ("actor_gen", "ref_inf", "actor_prox", "actor_train")
STALENESS, PUSH_EVERY = 2, 1


def partial_overrides() -> list[str]:
    return ["plan.execution=async", f"plan.staleness={STALENESS}", f"plan.push_every={PUSH_EVERY}",
            "plan.partial_rollouts=true", *layout_overrides(SPLIT, GRPO_MFCS)]


def test_tokens_span_two_versions_within_the_bound(tmp_path):
    steps = 8
    run = restage_run(tmp_path, "grpo_tiny", 2, "partial", f"run.steps={steps}", *partial_overrides())
    ahead = lookahead(STALENESS, PUSH_EVERY, partial=True)
    assert ahead == 1
    # Logged at the generate of step s (batch s + 1 finished, batch s + 2 begun): the fraction of batch s + 2's
    # samples cut mid-answer, and its tokens written so far per sample. The last two steps begin nothing.
    cut_samples, cut_tokens = run.stat("actor_gen/cut_samples"), run.stat("actor_gen/cut_tokens")
    answer_tokens = run.stat("actor_gen/answer_tokens")  # per sample of the batch finished at step s
    assert len(cut_samples) == steps - 1 and cut_samples[-1] == 0 and cut_tokens[-1] == 0
    assert (cut_samples[:-1] > 0).all()  # every batch but the last is begun early, and some answers cut
    mixed = run.stat("actor_gen/mixed_version_samples")
    np.testing.assert_array_equal(mixed, [0.0, 0.0, *cut_samples[:steps - 2]])
    # The batch's oldest token: version t - 2 where step t - 2 wrote any of it, else t - 1 (warm-up: 0).
    expected = [0.0, 0.0] + [float(t - 2 if cut_tokens[t - 2] > 0 else t - 1) for t in range(2, steps)]
    np.testing.assert_array_equal(run.stat("actor_gen/behaviour_version"), expected)

    gap = {g: run.stat(f"actor_train/version_gap_{g}") for g in range(STALENESS + 1)}
    np.testing.assert_array_equal(gap[0], [1.0] + [0.0] * (steps - 1))  # batch 0: the warm-up, trained at step 0
    np.testing.assert_array_equal(gap[1][:2], [0.0, 1.0])  # batch 1: generated whole at step 0
    np.testing.assert_allclose(gap[1] + gap[2], [0.0] + [1.0] * (steps - 1), rtol=0, atol=1e-12)
    assert (run.stat("actor_train/version_gap_max") <= STALENESS).all()
    # Tokens at gap 2 are those written at step t - 2: per token, over the micro-batches' fractions (2 halves).
    share = cut_tokens[:steps - 2] / answer_tokens[1:steps - 1]
    np.testing.assert_allclose(gap[2][2:], share, rtol=0, atol=0.03)
    assert (gap[2][2:] > 0).all()


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
