"""Async mode (`plan.execution: async`) under `restage run -n 2`: the actor generates on rank 1 while rank 0 trains.

Every trained token's policy version is checked against the program's rule (the batch of step t was generated
at step t - ahead by the weights of the last push), which keeps every gap within `plan.staleness`; the weight
pushes are logged at the steps they are due.
"""

import numpy as np
import pytest
from e2e_jobs import ASYNC_SPLIT as SPLIT
from e2e_jobs import GRPO_MFCS, PPO_MFCS, REMAX_MFCS, layout_overrides, report, restage_run

from restage.report.log import read_log
from restage.schedule.async_program import lookahead

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]



def async_overrides(staleness: int, push_every: int, mfcs=GRPO_MFCS) -> list[str]:
    return ["plan.execution=async", f"plan.staleness={staleness}", f"plan.push_every={push_every}",
            *layout_overrides(SPLIT, mfcs)]


def behaviour_version(step: int, staleness: int, push_every: int) -> int:
    """The version that generated loop step ``step``'s batch: the warm-up's 0, else the last push before it was made."""
    ahead = lookahead(staleness, push_every)
    if step < ahead:
        return 0
    made_at = step - ahead
    return made_at - made_at % push_every


@pytest.mark.parametrize("job, mfcs, staleness, push_every, steps", [
    ("grpo_tiny", GRPO_MFCS, 1, 1, 4), ("grpo_tiny", GRPO_MFCS, 2, 2, 6),
    # two generate MFCs ahead: sampled answers and the greedy baseline (make test-scale: make test's time bound)
    pytest.param("remax_tiny", REMAX_MFCS, 1, 1, 4, marks=pytest.mark.scale),
])
def test_every_trained_token_is_within_the_staleness_bound(tmp_path, job, mfcs, staleness, push_every, steps):
    run = restage_run(tmp_path, job, 2, "async", f"run.steps={steps}", *async_overrides(staleness, push_every, mfcs))
    expected = np.array([behaviour_version(s, staleness, push_every) for s in range(steps)], dtype=float)
    gaps = np.arange(steps) - expected
    assert gaps.max() == staleness and gaps.min() >= 0
    np.testing.assert_array_equal(run.stat("actor_gen/behaviour_version"), expected)
    # Each batch is one version's, so every answer token of step t has gap t - version: mean and max both equal it.
    np.testing.assert_array_equal(run.stat("actor_train/version_gap_mean"), gaps)
    np.testing.assert_array_equal(run.stat("actor_train/version_gap_max"), gaps)
    histogram = sum(run.stat(f"actor_train/version_gap_{g}") for g in range(staleness + 1))
    np.testing.assert_allclose(histogram, 1.0, rtol=0, atol=1e-12)  # no token outside 0..k
    ahead = lookahead(staleness, push_every)
    occupancy = [min(ahead - 1, steps - 1 - s) for s in range(steps)]
    np.testing.assert_array_equal(run.stat("actor_gen/buffer_batches"), occupancy)

    log = read_log(run.trial_dir)
    pushes = log.transfers[(log.transfers["kind"] == "realloc") & (log.transfers["name"] == "push:actor")]
    due = [s + 1 for s in range(steps) if s % push_every == 0]
    assert sorted({int(s) for s in pushes["step"]}) == due
    sent = pushes[pushes["rank"] == 0]
    assert len(sent) == len(due) and (sent["num_bytes"] > 0).all()
    assert len(set(sent["num_bytes"])) == 1  # the whole actor each time
    rows = log.mfcs
    assert set(rows[np.isin(rows["name"], ["actor_gen", "actor_greedy_gen"])]["rank"]) == {1}
    assert set(rows[rows["name"] == "actor_train"]["rank"]) == {0}
    for name in {"actor_gen", "actor_greedy_gen"} & set(mfcs):
        generated = [int((rows[rows["name"] == name]["step"] == s + 1).sum()) for s in range(steps)]
        assert sum(generated) == steps and generated[0] == min(ahead + 1, steps)  # each batch once; the warm-up first
    # A step's tokens (its row, the progress line's and the report's tokens/s) are those of the batch it trains on,
    # which the reference scores on rank 0 that step; not the batches generated that step (two at the first, none
    # at the last: it printed 0 tokens/s).
    ref = rows[rows["name"] == "ref_inf"]
    trained = [int(ref["tokens"][ref["step"] == s + 1].sum()) for s in range(steps)]
    assert min(trained) > 0
    np.testing.assert_array_equal(log.steps["tokens"][np.argsort(log.steps["step"])], trained)


WINDOW = 5  # steps averaged at each end of the reward curve, as tests/e2e/test_rl_learning.py


# PPO's case in make test-scale (make test's time bound); GRPO's in make test
@pytest.mark.parametrize("job, steps, mfcs", [pytest.param("ppo_tiny", 40, PPO_MFCS, marks=pytest.mark.scale),
                                              ("grpo_tiny", 50, GRPO_MFCS)])
def test_async_raises_reward_by_the_sync_margin(tmp_path, job, steps, mfcs):
    """The sync learning test's job, steps and margin (tests/e2e/test_rl_learning.py), trained one version stale."""
    margin = 0.10
    run = restage_run(tmp_path, job, 2, "async", f"run.steps={steps}", *async_overrides(1, 1, mfcs))
    reward = run.stat("actor_train/reward")
    start, end = float(reward[:WINDOW].mean()), float(reward[-WINDOW:].mean())
    assert end - start >= margin, f"async {job} reward {start:.3f} -> {end:.3f} in {steps} steps"
    np.testing.assert_array_equal(run.stat("actor_train/version_gap_mean"), [0.0] + [1.0] * (steps - 1))
    report(f"async {job.removesuffix('_tiny')}", steps=steps, reward_start=start, reward_end=end, gain=end - start,
           seconds=run.seconds)


def test_push_moves_tp2_training_shards_to_the_generation_rank(tmp_path):
    """3 ranks: the actor trains tp2 on ranks 0-1 and generates on rank 2; each push sends every shard from the
    rank that holds it (shard to shard, no gather on one rank), and the bound holds."""
    layouts = {"actor_gen": "ranks:2-2 dp1", "ref_inf": "ranks:0-1 dp2", "actor_prox": "ranks:0-1 tp2",
               "actor_train": "ranks:0-1 tp2"}
    run = restage_run(tmp_path, "grpo_tiny", 3, "async3", "run.steps=3", "plan.execution=async",
                      *layout_overrides(layouts, GRPO_MFCS))
    np.testing.assert_array_equal(run.stat("actor_train/version_gap_mean"), [0.0, 1.0, 1.0])
    log = read_log(run.trial_dir)
    pushes = log.transfers[(log.transfers["kind"] == "realloc") & (log.transfers["name"] == "push:actor")]
    sent = {rank: pushes["num_bytes"][pushes["rank"] == rank] for rank in (0, 1, 2)}
    assert len(sent[0]) == len(sent[1]) == 3 and (sent[0] > 0).all() and (sent[1] > 0).all()
    assert (sent[2] == 0).all()  # the generation rank only receives
    # each tp rank sends its own half of the sharded weights (the replicated norms once between them)
    assert abs(int(sent[0][0]) - int(sent[1][0])) < 0.1 * int(sent[0][0])
