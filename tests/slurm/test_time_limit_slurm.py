"""One node: a run longer than its time limit finishes through requeues, to the uninterrupted run's log, statistics
and weights (tests/multinode/test_time_limit_multinode.py does it on two nodes). Here the reference job and the
limited one run side by side on the local cluster's one node.

``slurm.time_minutes=10`` with ``run.save_before_end_seconds=595``: every attempt checkpoints and stops at its first
step boundary (less than 595 s are left after any start-up), at any load, so STEPS=2 is two attempts, one requeue by
the deadline rule (tests/multinode does STEPS=3: a resumed attempt stopped by the rule again). Everything else is
the real path: SLURM's end time, RESTAGE_DEADLINE (a requeued job's new one: with the old one the second attempt
would be stopped by the driver's last resort at once, every time), the rule, TIME_LIMIT, the driver's self-USR2,
submitit's requeue and the resume. The estimates' arithmetic is tests/runtime/test_deadline_on_cpu.py's.

Why not SLURM's smallest limit, one minute: an attempt's start-up (submitit starting the driver, then the ranks'
imports, DeepSpeed ops, engines, on resume the checkpoint) and its first step must end before the driver's last
resort 8 s before the limit, or a SLURM signal before that. On this 2-core machine under other tests' load, start-up
took 15-45 s at load 20-30 and 100-165 s at load 60-110 (the driver alone 10-40 s): every attempt of a one-minute
job, and of a two-minute one, was requeued by the last resort before its first step until slurm.max_requeues ran
out. The rule stops an attempt at its first boundary whatever the limit, so a longer one costs nothing on a quiet
machine; ten minutes leave start-up about 8 (a 10-minute job's --signal comes 90 s before its end, up to a minute
early). An attempt whose start-up outlasts that is requeued by the signal or the last resort (outcome without
"before the time limit", no step lost); the assertions allow it. The reference runs under the partition's 30
minutes: it must not be signalled (its attempts are checked). Timings are printed (pytest -s)."""

import re
import time

import pytest
import torch
from slurm_jobs import RELAYOUT_PLAN, failure_report, hf_tensors, stats_by_step, submit_real, wait_finished
from slurm_queue import finish_through_requeues

from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.runtime.checkpoint import checkpoint_dir

pytestmark = pytest.mark.slurm
STEPS = 2
SAME_RUN = (f"run.steps={STEPS}", "run.save_every=0", "slurm.max_requeues=10", *RELAYOUT_PLAN)
LIMITED = ("slurm.time_minutes=10", "run.save_before_end_seconds=595")


def test_a_run_longer_than_its_time_limit_reaches_its_last_step_through_requeues(tiny_model, tmp_path):
    start = time.monotonic()
    reference_id, reference = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "unlimited", *SAME_RUN,
                                          "slurm.time_minutes=30")
    job_id, trial = submit_real("jobs/ppo_tiny.yaml", tmp_path / "results", "limited", *SAME_RUN, *LIMITED)
    state, released = finish_through_requeues(job_id, 1200)
    assert state == "COMPLETED", f"{state}:\n{failure_report(trial)}"
    assert wait_finished(reference_id, 600) == "COMPLETED", failure_report(reference)
    assert [a["outcome"] for a in read_json(reference / "job.json")["attempts"]] == ["completed"]  # uninterrupted
    wall_seconds = time.monotonic() - start

    attempts = read_json(trial / "job.json")["attempts"]
    log, theirs = read_log(trial / "log.h5"), read_log(reference / "log.h5")
    print(f"\none-node time limit: job {job_id}, {STEPS} PPO steps under {LIMITED}: {len(attempts)} attempts, "
          f"resumed at steps {log.resumed_at_steps}, {released} BeginTime holds released; {wall_seconds:.0f} s from "
          f"submission (the reference included); outcomes {[a['outcome'] for a in attempts]}")
    assert [(a["restarts"], a["resume"]) for a in attempts] == [(i, i > 0) for i in range(len(attempts))]
    assert attempts[-1]["outcome"] == "completed"
    # Each earlier attempt: "requeued after checkpoint at step N before the time limit" (the deadline rule, N the
    # step it stopped at), or "requeued after checkpoint at step N" with N the previous attempt's (the last resort).
    outcomes = [re.fullmatch(r"requeued after checkpoint at step (\d+|none)( before the time limit)?", a["outcome"])
                for a in attempts[:-1]]
    assert all(outcomes), [a["outcome"] for a in attempts]
    saved_at = [int(m.group(1).replace("none", "0")) for m in outcomes]
    by_rule = [s for s, m in zip(saved_at, outcomes) if m.group(2)]
    assert by_rule == list(range(1, STEPS))  # a requeue by the deadline rule at every step but the last
    assert saved_at == sorted(saved_at)
    output = (trial / "output.log").read_text(errors="replace")
    for step in by_rule:
        assert f"restage: checkpointing at step {step} and stopping: " in output
    assert sorted(set(log.resumed_at_steps)) == list(range(1, STEPS))

    assert [int(s) for s in log.steps["step"]] == [int(s) for s in theirs.steps["step"]] == list(range(1, STEPS + 1))
    assert (log.closed, log.last_complete_step) == (True, STEPS)
    assert stats_by_step(log) == stats_by_step(theirs)  # every statistic of every step, exactly
    for model in ("actor", "critic"):
        mine = hf_tensors(checkpoint_dir.final_dir(trial, STEPS), model)
        ref = hf_tensors(checkpoint_dir.final_dir(reference, STEPS), model)
        assert sorted(mine) == sorted(ref)
        assert all(torch.equal(mine[name], ref[name]) for name in mine), f"{model} weights differ"
