"""A 4-rank run with the actor in different layouts for generation and training, two MFCs on disjoint meshes
at the same time, equals a 1-rank run of the same job."""

import pytest
import torch
from runs import hf_weights, last_checkpoint, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

# Greedy generation makes the sampled data independent of the layout; training layouts use no data
# parallelism, so each optimizer step sees exactly the batch the 1-rank run sees.
COMMON = ["jobs/ppo_tiny.yaml", "run.steps=3", "run.batch_size=16", "run.micro_batches=2", "generation.greedy=true",
          "algo.minibatches=2", "algo.ppo_epochs=1"]
FOUR = ["plan.mode=manual", "plan.layouts.actor_gen=ranks:0-3 dp4", "plan.layouts.ref_inf=ranks:0-1 dp2",
        "plan.layouts.critic_inf=ranks:2-3 pp2", "plan.layouts.actor_train=ranks:0-3 tp2pp2",
        "plan.layouts.critic_train=ranks:2-3 pp2"]


def test_four_rank_relayout_run_equals_one_rank_run(tmp_path):
    one = restage_run(tmp_path, *COMMON, "-n", "1", "trial=one", "plan.mode=manual",
                      *[f"plan.layouts.{m}=ranks:0 dp1" for m in
                        ("actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train")])
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    four = restage_run(tmp_path, *COMMON, "-n", "4", "trial=four", *FOUR)
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]

    trial_one, trial_four = tmp_path / "ppo-tiny" / "one", tmp_path / "ppo-tiny" / "four"
    for model in ("actor", "critic"):
        a = hf_weights(last_checkpoint(trial_one) / model / "hf")
        b = hf_weights(last_checkpoint(trial_four) / model / "hf")
        assert a.keys() == b.keys()
        # Whole-model relative difference <= 1e-5; single tensors may carry a little more of the
        # reduction-order noise (TP all-reduces sum in another order, and Adam rescales small gradients).
        flat_a, flat_b = (torch.cat([w[n].flatten() for n in sorted(w)]) for w in (a, b))
        total = ((flat_a - flat_b).norm() / flat_a.norm()).item()
        assert total <= 1e-5, f"{model}: relative difference {total:.2e}"
        for name in a:
            diff = (a[name] - b[name]).norm() / a[name].norm().clamp(min=1e-12)
            assert diff <= 1e-4, f"{model} {name}: relative difference {diff:.2e}"

    log = read_log(trial_four)
    assert log.last_complete_step == 3 and len(log.steps) == 3
    reallocs = [row for row in log.transfers if row["kind"] == "realloc"]
    # Every step reallocates the actor (train tp2pp2 -> generate dp4); the critic infers in its training layout.
    assert {int(row["step"]) for row in reallocs} == {1, 2, 3}
    assert {row["name"] for row in reallocs} == {"actor"}
    assert all(row["num_bytes"] > 0 for row in reallocs if row["rank"] in (0, 1) and row["name"] == "actor")
    mfcs = log.mfcs
    overlapping = 0
    for step in range(1, 4):
        ref = [r for r in mfcs if r["step"] == step and r["name"] == "ref_inf"]
        critic = [r for r in mfcs if r["step"] == step and r["name"] == "critic_inf"]
        assert {r["rank"] for r in ref} == {0, 1} and {r["rank"] for r in critic} == {2, 3}
        # Disjoint meshes: the two inference MFCs run at the same time. Four processes share two
        # cores here, so one step's scheduling noise may separate them; across steps they must overlap.
        overlapping += (min(r["start_seconds"] for r in critic) < max(r["end_seconds"] for r in ref)
                        and min(r["start_seconds"] for r in ref) < max(r["end_seconds"] for r in critic))
    assert overlapping >= 1
    one_stats, four_stats = read_log(trial_one).stat_series(), read_log(trial_four).stat_series()
    for name in ("actor_train/reward", "critic_train/loss"):
        torch.testing.assert_close(torch.tensor(four_stats[name][1]), torch.tensor(one_stats[name][1]), rtol=1e-4, atol=1e-6)
