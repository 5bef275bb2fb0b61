"""One node: a run longer than its time limit finishes through requeues, to the uninterrupted run's log, statistics
and weights (tests/multinode/test_time_limit_multinode.py does it on two nodes and says why
``run.save_before_end_seconds=55``: one step per attempt at any load, so three steps are three attempts).

Here the reference job and the limited one run side by side on the local cluster's one node."""

import re

import pytest
import torch
from slurm_jobs import RELAYOUT_PLAN, failure_report, hf_tensors, stats_by_step, submit_real, wait_finished
from slurm_queue import finish_through_requeues

from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.runtime import checkpoint_dir

pytestmark = pytest.mark.slurm
STEPS = 3
SAME_RUN = (f"run.steps={STEPS}", "run.save_every=0", "slurm.max_requeues=10", *RELAYOUT_PLAN)


def test_a_run_longer_than_its_time_limit_reaches_its_last_step_through_requeues(tiny_model, tmp_path):
    reference_id, reference = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "unlimited", *SAME_RUN)
    job_id, trial = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "limited", *SAME_RUN,
                                "slurm.time_minutes=1", "run.save_before_end_seconds=55")
    state, _ = finish_through_requeues(job_id, 900)
    assert state == "COMPLETED", f"{state}:\n{failure_report(trial)}"
    assert wait_finished(reference_id) == "COMPLETED", failure_report(reference)

    attempts = read_json(trial / "job.json")["attempts"]
    assert attempts[-1]["outcome"] == "completed"
    by_rule = [int(m.group(1)) for a in attempts[:-1]
               if (m := re.fullmatch(r"requeued after checkpoint at step (\d+) before the time limit", a["outcome"]))]
    assert by_rule == list(range(1, STEPS))  # two requeues by the deadline rule, a step each
    log, theirs = read_log(trial / "log.h5"), read_log(reference / "log.h5")
    assert sorted(set(log.resumed_at_steps)) == list(range(1, STEPS))
    assert [int(s) for s in log.steps["step"]] == [int(s) for s in theirs.steps["step"]] == list(range(1, STEPS + 1))
    assert (log.closed, log.last_complete_step) == (True, STEPS)
    assert stats_by_step(log) == stats_by_step(theirs)
    for model in ("actor", "critic"):
        mine = hf_tensors(checkpoint_dir.final_dir(trial, STEPS), model)
        ref = hf_tensors(checkpoint_dir.final_dir(reference, STEPS), model)
        assert sorted(mine) == sorted(ref)
        assert all(torch.equal(mine[name], ref[name]) for name in mine), f"{model} weights differ"
