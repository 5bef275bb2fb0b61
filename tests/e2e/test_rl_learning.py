"""PPO, GRPO, ReMax and RAFT raise the sort task's programmatic reward under `restage run` (fixed seed, CPU).

The reward is the mean of `actor_train/reward` (the reward of the answers sampled that step) as
log.h5 holds it, over the first and the last five steps. PPO and GRPO run on 2 ranks with the actor
generating in dp2 and training in tp2, so every step reallocates its parameters between the two
layouts inside the learning loop; the tests check the log's reallocation rows too.
"""

import numpy as np
import pytest
from e2e_jobs import RELAYOUT, layout_overrides, report, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.e2e, pytest.mark.multirank]

WINDOW = 5  # steps averaged at each end of the reward curve


def _reward_gain(run) -> tuple[float, float]:
    reward = run.stat("actor_train/reward")
    return float(reward[:WINDOW].mean()), float(reward[-WINDOW:].mean())


def _check_actor_reallocated_every_step(run, steps: int) -> int:
    log = read_log(run.trial_dir)
    layouts = {m["name"]: m["layout"] for m in log.schedule["mfcs"]}
    assert layouts["actor_gen"] != layouts["actor_train"]
    moves = log.transfers[(log.transfers["kind"] == "realloc") & (log.transfers["name"] == "actor")]
    assert sorted({int(s) for s in moves["step"]}) == list(range(1, steps + 1))  # steps count from 1
    per_step = np.array([moves["num_bytes"][moves["step"] == s].sum() for s in range(1, steps + 1)])
    assert (per_step > 0).all()
    return int(per_step[0])


@pytest.mark.parametrize("job, steps, mfcs", [
    ("ppo_tiny", 40, ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")),
    ("grpo_tiny", 50, ("actor_gen", "ref_inf", "actor_train")),
])
def test_raises_reward_with_reallocation_in_the_loop(tmp_path, job, steps, mfcs):
    margin, name = 0.10, job.removesuffix("_tiny")
    run = restage_run(tmp_path, job, 2, "e2e", f"run.steps={steps}", *layout_overrides(RELAYOUT, mfcs))
    start, end = _reward_gain(run)
    assert end - start >= margin, f"{name.upper()} reward {start:.3f} -> {end:.3f} in {steps} steps"
    realloc_bytes = _check_actor_reallocated_every_step(run, steps)
    report(name, steps=steps, reward_start=start, reward_end=end, gain=end - start, realloc_bytes_per_step=realloc_bytes,
           seconds=run.seconds)


# ReMax on 2 ranks with every MFC in dp2: the train step's per-sequence baseline rewards come from
# another generation (other sequence lengths) and must be cut over DP as its sampled sequences are.
REMAX_DP2 = ["-n", "2", *layout_overrides({m: "ranks:0-1 dp2" for m in ("actor_gen", "actor_greedy_gen", "ref_inf",
                                                                           "actor_train")},
                                           ("actor_gen", "actor_greedy_gen", "ref_inf", "actor_train"))]


# remax (about 40 s) in make test-scale only: make test's time bound
@pytest.mark.parametrize("job, steps, placement", [pytest.param("remax_tiny", 60, REMAX_DP2, marks=pytest.mark.scale),
                                                   ("raft_tiny", 40, ["-n", "1"])])
def test_remax_and_raft_raise_reward(tmp_path, job, steps, placement):
    margin = 0.08
    nprocs, overrides = int(placement[1]), placement[2:]
    run = restage_run(tmp_path, job, nprocs, "e2e", f"run.steps={steps}", *overrides)
    start, end = _reward_gain(run)
    assert end - start >= margin, f"{job} reward {start:.3f} -> {end:.3f} in {steps} steps"
    report(job.removesuffix("_tiny"), steps=steps, ranks=nprocs, reward_start=start, reward_end=end, gain=end - start,
           seconds=run.seconds)
