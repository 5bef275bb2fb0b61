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
