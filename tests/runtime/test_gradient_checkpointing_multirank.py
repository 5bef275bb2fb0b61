"""Real two-rank GRPO runs with the actor's gradient checkpointing on (models.actor.gradient_checkpointing) log
exactly the statistics of the same runs without it: under ZeRO-3 over dp2 (DeepSpeed gathers the partitions again
for the recomputation) and under tp2 (the recomputed blocks all-reduce again, in the same order on both ranks)."""

import pytest
from runs import restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

GRPO = ["jobs/grpo_tiny.yaml", "-n", "2", "run.steps=3", "plan.mode=manual", "plan.layouts.ref_inf=ranks:0-1 dp2"]
LAYOUTS = {"zero3-dp2": ["plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 dp2",
                         "models.actor.zero_stage=3"],
           "tp2": ["plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2"]}


# tp2 (about 30 s) in make test-scale only: make test's time bound
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.scale) if k == "tp2" else k for k in sorted(LAYOUTS)])
def test_checkpointed_training_logs_the_statistics_of_plain_training(tmp_path, layout):
    for trial, extra in (("plain", []), ("recompute", ["models.actor.gradient_checkpointing=true"])):
        done = restage_run(tmp_path, *GRPO, *LAYOUTS[layout], f"trial={trial}", *extra)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plain, recompute = (read_log(tmp_path / "grpo-tiny" / t).stat_series() for t in ("plain", "recompute"))
    timing = ("seconds", "memory", "bytes", "time")
    names = sorted(n for n in plain if not any(word in n for word in timing))
    assert names == sorted(n for n in recompute if not any(word in n for word in timing))
    # two minibatches a step: the second's KL to the behaviour policy follows from the first's gradients
    assert "actor_train/approx_kl" in names, names
    for name in names:
        assert plain[name][0].tolist() == recompute[name][0].tolist() == [1, 2, 3], name
        assert plain[name][1].tolist() == recompute[name][1].tolist(), name
