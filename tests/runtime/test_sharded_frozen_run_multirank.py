"""A real two-rank GRPO run whose reference model is held 1/dp per rank (models.ref.shard_frozen) logs exactly the
statistics of the same run with the reference whole: the sharded forward computes what the whole one does."""

import pytest
from runs import restage_run

from restage.report.log import read_log
from restage.schedule.file import read_schedule

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

# Every MFC over both ranks, dp2: the reference's inference is its home, gathered from the other rank's halves.
GRPO = ["jobs/grpo_tiny.yaml", "-n", "2", "run.steps=3", "plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2",
        "plan.layouts.ref_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 dp2"]


def test_a_sharded_reference_logs_the_statistics_of_a_whole_one(tmp_path):
    for trial, extra in (("whole", []), ("sharded", ["models.ref.shard_frozen=true"])):
        done = restage_run(tmp_path, *GRPO, f"trial={trial}", *extra)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    models = {t: read_schedule(tmp_path / "grpo-tiny" / t / "schedule.json").models["ref"] for t in ("whole", "sharded")}
    assert (models["whole"].shard_frozen, models["sharded"].shard_frozen) == (False, True)
    whole, sharded = (read_log(tmp_path / "grpo-tiny" / t).stat_series() for t in ("whole", "sharded"))
    timing = ("seconds", "memory", "bytes", "time")
    names = sorted(n for n in whole if not any(word in n for word in timing))
    assert names == sorted(n for n in sharded if not any(word in n for word in timing))
    assert any("kl" in n for n in names), names  # the reference's log-probs reach the statistics
    for name in names:
        assert whole[name][0].tolist() == sharded[name][0].tolist() == [1, 2, 3], name
        assert whole[name][1].tolist() == sharded[name][1].tolist(), name
