"""--resume of a trial with nothing saved is refused before any rank starts; a trial whose run failed before its
first step can be started again without --overwrite (no loop between "pass --resume" and "run without it"); an
edited YAML is compared with the trial's config: more steps apply, a new learning rate is refused."""

import os
import time

import pytest
import yaml
from runs import ROOT, restage_run

from restage.config.paths import resolve_file_paths
from restage.report.log import read_log
from restage.runtime.control.threads import cgroup_cpus, threads_for

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=2"]


def test_a_trial_that_failed_before_its_first_step_starts_again(tmp_path):
    trial = tmp_path / "ppo-tiny" / "t"
    failed = restage_run(tmp_path, *JOB, "trial=t", "reward_fn=faulty_reward:broken", timeout=300)
    assert failed.returncode != 0 and "reward function broke before the first step" in failed.stderr
    assert read_log(trial).last_complete_step == 0  # steps count from 1: none complete
    started = time.monotonic()
    resumed = restage_run(tmp_path, "jobs/ppo_tiny.yaml", "-n", "2", "trial=t", "--resume", timeout=120)
    assert time.monotonic() - started < 30 and resumed.returncode == 2
    assert resumed.stderr.strip().splitlines() == [
        f"restage: error: {trial} has no checkpoint to resume from (no step of it was saved); run it without "
        "--resume to start it afresh"]
    # Without OMP_NUM_THREADS each rank takes its share of the cores it may use (mpirun binds none locally).
    again = restage_run(tmp_path, *JOB, "trial=t", timeout=300, env={"OMP_NUM_THREADS": ""})
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    for rank in range(2):
        expected = threads_for(os.sched_getaffinity(0), 2, rank, {}, 0, cgroup_cpus())
        assert f"restage: rank {rank}: {expected.count} torch thread(s) ({expected.reason})" in again.stdout
    assert f"restage: {trial}: the earlier run ended before its first step; starting it afresh" in again.stdout
    assert read_log(trial).last_complete_step == 2


def _job_yaml(path, **run):
    """jobs/ppo_tiny.yaml with these run keys, written to ``path`` (the test edits it between runs)."""
    data = yaml.safe_load((ROOT / "jobs" / "ppo_tiny.yaml").read_text())
    resolve_file_paths(data, ROOT / "jobs" / "ppo_tiny.yaml")  # its paths are relative to jobs/, not to ``path``
    data["run"].update(run)
    path.write_text(yaml.safe_dump(data))
    return data


def test_resume_applies_an_edited_step_count_and_refuses_an_edited_learning_rate(tmp_path):
    trial, config = tmp_path / "ppo-tiny" / "y", tmp_path / "job.yaml"
    data = _job_yaml(config, steps=2, batch_size=8)
    layouts = ["plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
               "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 dp2",
               "plan.layouts.critic_train=ranks:0-1 dp2"]
    first = restage_run(tmp_path, str(config), "-n", "2", "trial=y", *layouts, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert read_log(trial).last_complete_step == 2

    data["models"]["actor"]["optim"]["lr"] = 2.0e-3
    config.write_text(yaml.safe_dump(data))
    log_bytes = (trial / "log.h5").read_bytes()
    started = time.monotonic()
    refused = restage_run(tmp_path, str(config), "trial=y", "--resume", timeout=120)
    assert time.monotonic() - started < 30 and refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "restage: error: --resume cannot change models.actor.optim.lr 0.001 -> 0.002 (the checkpoint was trained "
        "with the old value); undo it, or start a new trial=NAME (on resume only run.steps, run.stop_at_step, "
        "run.save_every, run.keep_checkpoints, run.eval_every, run.log_every, run.startup_timeout_seconds, "
        "run.collective_timeout_seconds, run.peer_wait_timeout_seconds, run.activity_timeout_seconds, run.nonfinite, "
        "run.max_skipped_steps, "
        "run.save_before_end_seconds, slurm.* may change)"]
    assert (trial / "log.h5").read_bytes() == log_bytes  # no rank started

    data["models"]["actor"]["optim"]["lr"] = 1.0e-3
    data["run"]["steps"] = 4
    config.write_text(yaml.safe_dump(data))
    extended = restage_run(tmp_path, str(config), "trial=y", "--resume", timeout=300)
    assert extended.returncode == 0, extended.stdout[-2000:] + extended.stderr[-2000:]
    assert "restage: --resume applies run.steps 2 -> 4" in extended.stdout.splitlines()
    log = read_log(trial)
    assert (log.last_complete_step, log.resumed_at_steps) == (4, [2])
    assert [p.name for p in sorted((trial / "checkpoints").glob("step-*"))] == ["step-2", "step-4"]

    done = restage_run(tmp_path, str(config), "trial=y", "--resume", timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"restage: error: {trial}: all 4 steps are done (checkpoint step-4); to train on, resume with a larger "
        "run.steps (e.g. run.steps=8)"]
