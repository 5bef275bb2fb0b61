"""A run longer than its time limit finishes through requeues: the tiny PPO job on two nodes x two ranks checkpoints
before each attempt's limit (runtime/control/deadline.py: the master compares the time left with the end time the driver
hands the ranks), the driver requeues it, and the run reaches its last step with the same log, statistics and
weights, bit for bit, as the same job run without a limit.

How many steps fit in an attempt depends on the machine's load (start-up alone took 15-45 s at load 20-30, steps
0.8-1.5 s): with the automatic rule an attempt did 1 to about 35 steps. ``run.save_before_end_seconds=595`` under
``slurm.time_minutes=10`` makes it exact: every attempt stops at its first step boundary (less than 595 s are left
after any start-up), so STEPS=3 is three attempts, two requeues by the rule, the second from a resumed attempt. The
rule, the end time (a requeued job's new one), the TIME_LIMIT file, the driver's requeue and the resume are the real
ones; the estimates' arithmetic is tests/runtime/test_deadline_on_cpu.py's.

Why ten minutes and not SLURM's smallest limit, one (which this test used first): an attempt's start-up and first
step must end before the driver's last resort 8 s before the limit (or a SLURM signal, 90 s before a 10-minute
job's end, up to a minute early). At load 60-110 on this 2-core machine submitit alone took 40 s to start the
driver and the ranks' start-up over 100 s, so every attempt of a one-minute job was requeued by the last resort
before its first step (at load 20-30, 3 of 5 requeues were). The rule stops an attempt at its first boundary
whatever the limit, so the longer one costs nothing when the machine is quiet. An attempt whose start-up outlasts
it anyway is requeued by the signal or the last resort (no step is lost: it had none); the assertions allow it.
Timings are printed (pytest -s) for the report.
"""

import os
import re
import time

import pytest
import torch
from multinode_jobs import failure_report, hf_tensors, submit, wait_finished
from slurm_queue import finish_through_requeues

from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.runtime.checkpoint import checkpoint_dir

# make test-scale runs it (make test's time bound); tests/slurm/test_time_limit_slurm.py is the one-node run in make test
pytestmark = [pytest.mark.multinode, pytest.mark.scale]
TRAINED = ("actor", "critic")
STEPS = 3
SAME_RUN = (f"run.steps={STEPS}", "run.save_every=0", "slurm.max_requeues=10")
# RESTAGE_TIME_LIMIT_MINUTES=1 runs it under SLURM's smallest limit instead (a quiet machine: the run outlasts it).
MINUTES = int(os.environ.get("RESTAGE_TIME_LIMIT_MINUTES", "10"))
LIMITED = (f"slurm.time_minutes={MINUTES}", f"run.save_before_end_seconds={MINUTES * 60 - 5}")


def stats_by_step(log) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in log.stats:
        out.setdefault(int(row["step"]), {})[str(row["name"])] = float(row["value"])
    return out


def test_a_run_longer_than_its_time_limit_reaches_its_last_step_through_requeues(tiny_model, tmp_path):
    start = time.monotonic()
    # Both submitted at once: the limited job waits for two free nodes, then its one-minute clock starts.
    reference_id, reference = submit(tmp_path / "reference", "unlimited", "mpirun", *SAME_RUN)
    job_id, trial = submit(tmp_path / "limited", "limited", "mpirun", *SAME_RUN, *LIMITED)
    assert wait_finished(reference_id) == "COMPLETED", failure_report(reference)
    assert [a["outcome"] for a in read_json(reference / "job.json")["attempts"]] == ["completed"]  # uninterrupted
    state, released = finish_through_requeues(job_id, 1200)
    wall_seconds = time.monotonic() - start
    assert state == "COMPLETED", f"{state}:\n{failure_report(trial)}"

    attempts = read_json(trial / "job.json")["attempts"]
    log, theirs = read_log(trial / "log.h5"), read_log(reference / "log.h5")
    print(f"\nmultinode time limit: job {job_id}, {STEPS} PPO steps under {LIMITED}: {len(attempts)} "
          f"attempts, {len(attempts) - 1} requeues, resumed at steps {log.resumed_at_steps}, {released} BeginTime "
          f"holds released; {wall_seconds:.0f} s from submission (the reference included); outcomes "
          f"{[a['outcome'] for a in attempts]}")
    assert [(a["restarts"], a["resume"]) for a in attempts] == [(i, i > 0) for i in range(len(attempts))]
    assert attempts[-1]["outcome"] == "completed"
    # Each earlier attempt: "requeued after checkpoint at step N before the time limit" (the deadline rule), or
    # "requeued after checkpoint at step N" with N the previous attempt's (the last resort, after a start-up that
    # outlasted the minute).
    saved_at = [int(re.fullmatch(r"requeued after checkpoint at step (\d+|none)( before the time limit)?", a["outcome"])
                    .group(1).replace("none", "0")) for a in attempts[:-1]]
    by_rule = [a["outcome"].endswith(" before the time limit") for a in attempts[:-1]]
    assert [s for s, rule in zip(saved_at, by_rule) if rule] == list(range(1, STEPS))  # two requeues, a step each
    assert saved_at == sorted(saved_at)
    output = (trial / "output.log").read_text(errors="replace")
    for step in range(1, STEPS):
        assert f"restage: checkpointing at step {step} and stopping: " in output
    assert sorted(set(log.resumed_at_steps)) == list(range(1, STEPS))

    assert [int(s) for s in log.steps["step"]] == [int(s) for s in theirs.steps["step"]] == list(range(1, STEPS + 1))
    assert (log.closed, log.last_complete_step) == (True, STEPS)
    assert stats_by_step(log) == stats_by_step(theirs)  # every statistic of every step, exactly
    final, reference_final = checkpoint_dir.final_dir(trial, STEPS), checkpoint_dir.final_dir(reference, STEPS)
    for model in TRAINED:
        mine, ref = hf_tensors(final, model), hf_tensors(reference_final, model)
        assert sorted(mine) == sorted(ref)
        assert all(torch.equal(mine[name], ref[name]) for name in mine), f"{model} weights differ"
