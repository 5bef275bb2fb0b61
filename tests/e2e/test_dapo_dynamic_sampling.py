"""DAPO's dynamic sampling under `restage run` on 2 ranks (dp2): every step trains on a full batch of groups whose
rewards differ; the two dp ranks agree on the rounds (issue 31)."""

import numpy as np
import pytest
from e2e_jobs import layout_overrides, restage_run

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

MFCS = ("actor_gen", "ref_inf", "actor_train")
STEPS = 3


def test_dapo_dynamic_sampling_keeps_every_steps_batch_full_under_dp2(tmp_path):
    run = restage_run(tmp_path, "grpo_tiny", 2, "dapo", f"run.steps={STEPS}", "run.save_every=0",
                      "algo.dynamic_sampling=true", "algo.max_sampling_rounds=4", "algo.clip_eps_high=0.28",
                      "algo.loss_agg=token_mean", "algo.overlong_buffer=2",
                      *layout_overrides({m: "ranks:0-1 dp2" for m in MFCS}, MFCS))
    sequences = run.stat("actor_train/sequences")
    assert (sequences == 8 * 8).all(), sequences  # run.batch_size 8 prompts x group_size 8, every step
    dropped = run.stat("actor_gen/dynamic_sampling_dropped")
    rounds = run.stat("actor_gen/dynamic_sampling_rounds")
    unfilled = run.stat("actor_gen/dynamic_sampling_unfilled")
    informative = run.stat("actor_train/informative_groups")
    assert dropped.max() > 0, dropped  # the tiny task does give all-equal groups: the rounds had work
    assert ((rounds >= 1) == (dropped > 0)).all() and (rounds <= 4).all(), (rounds, dropped)
    # The whole batch (both ranks' halves) trains on groups whose rewards differ, but for the slots left unfilled.
    assert np.allclose(informative, 1 - unfilled), (informative, unfilled)
    print(f"dapo dp2: dropped {dropped}, rounds {rounds}, unfilled {unfilled}, {run.seconds:.0f} s")


def test_dapo_dynamic_sampling_fills_async_batches_generated_ahead(tmp_path):
    """Async mode (generation on rank 1, one step ahead): the generate op fills the batch of the step it generates
    for before buffering it, so every trained batch is full and holds the groups the rounds kept."""
    from e2e_jobs import ASYNC_SPLIT

    steps, mfcs = 5, ("actor_gen", "ref_inf", "actor_prox", "actor_train")
    run = restage_run(tmp_path, "grpo_tiny", 2, "dapo-async", f"run.steps={steps}", "run.save_every=0",
                      "algo.dynamic_sampling=true", "algo.max_sampling_rounds=4", "algo.clip_eps_high=0.28",
                      "algo.loss_agg=token_mean", "plan.execution=async", "plan.staleness=1",
                      "algo.group_size=2", "generation.temperature=0.2",  # pairs, cool: all-equal groups each step
                      *layout_overrides(ASYNC_SPLIT, mfcs))
    assert (run.stat("actor_train/sequences") == 8 * 2).all()
    # Logged where generation ran: step 0 generates batches 0 and 1 (their mean), step s > 0 batch s + 1.
    dropped = run.stat("actor_gen/dynamic_sampling_dropped")
    rounds = run.stat("actor_gen/dynamic_sampling_rounds")
    unfilled = run.stat("actor_gen/dynamic_sampling_unfilled")
    assert len(dropped) == steps - 1 and dropped.max() > 0, dropped  # all-equal groups were drawn and replaced
    assert ((rounds > 0) == (dropped > 0)).all() and (rounds <= 4).all(), (rounds, dropped)
    # Each trained batch's share of groups whose rewards differ is 1 - its share of slots left unfilled.
    informative = run.stat("actor_train/informative_groups")
    np.testing.assert_allclose(informative.sum(), steps - 2 * unfilled[0] - unfilled[1:].sum(), atol=1e-9)
    assert (run.stat("actor_train/version_gap_max") <= 1).all()
    print(f"dapo async: dropped {dropped}, rounds {rounds}, unfilled {unfilled}, {run.seconds:.0f} s")
