"""Resume is exact; a dead or failing rank takes the whole job down fast, naming it, and loses nothing written."""

import os
import signal
import time

import numpy as np
import pytest
import torch
from runs import hf_weights, last_checkpoint, rank_process, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

TWO_LAYOUTS = ["-n", "2", "plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
               "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2",
               "plan.layouts.critic_train=ranks:0-1 dp2"]
JOB = ["jobs/ppo_tiny.yaml", "run.batch_size=8", "run.steps=4", *TWO_LAYOUTS]


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_stop_and_resume_equals_a_straight_run_bitwise(tmp_path):
    _ok(restage_run(tmp_path, *JOB, "trial=straight"))
    _ok(restage_run(tmp_path, *JOB, "trial=split", "run.stop_at_step=2"))
    split = tmp_path / "ppo-tiny" / "split"
    assert read_log(split).last_complete_step == 2
    _ok(restage_run(tmp_path, "jobs/ppo_tiny.yaml", "-n", "2", "trial=split", "--resume"))
    straight = tmp_path / "ppo-tiny" / "straight"
    for model in ("actor", "critic"):
        a = hf_weights(last_checkpoint(straight) / model / "hf")
        b = hf_weights(last_checkpoint(split) / model / "hf")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), model
    log_a, log_b = read_log(straight), read_log(split)
    assert log_b.last_complete_step == 4 and log_b.resumed_at_steps == [2]  # resumed from checkpoint step-2
    series_a, series_b = log_a.stat_series(), log_b.stat_series()
    assert series_a.keys() == series_b.keys()
    for name in series_a:
        np.testing.assert_array_equal(series_a[name][0], series_b[name][0])
        np.testing.assert_array_equal(series_a[name][1], series_b[name][1], err_msg=name)
    np.testing.assert_array_equal(log_a.steps["tokens"], log_b.steps["tokens"])


def test_sigkill_of_one_rank_ends_the_job_and_keeps_log_and_checkpoint(tmp_path):
    trial = tmp_path / "ppo-tiny" / "killed"
    run = restage_run(tmp_path, *JOB, "run.steps=200", "run.save_every=2", "trial=killed", wait=False)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        steps = [p for p in (trial / "checkpoints").glob("step-*")] if (trial / "checkpoints").is_dir() else []
        if steps and (trial / "log.h5").is_file() and read_log(trial).last_complete_step >= 4:
            break
        assert run.poll() is None, run.stdout.read()[-3000:]
        time.sleep(0.5)
    victim = rank_process(str(trial), 1)
    assert victim is not None
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    output, _ = run.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60
    assert run.returncode != 0
    assert output.strip().splitlines()[-1].startswith("restage: error: rank 1 died from signal 9")
    assert rank_process(str(trial), 0) is None  # nobody left behind
    log = read_log(trial)
    assert log.last_complete_step >= 4 and log.steps["step"].tolist() == list(range(1, log.last_complete_step + 1))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(last_checkpoint(trial) / "actor" / "hf")
    assert sum(p.numel() for p in model.parameters()) > 0


def test_exception_inside_an_mfc_names_the_rank_and_error(tmp_path):
    trial = tmp_path / "ppo-tiny" / "broken"
    started = time.monotonic()
    done = restage_run(tmp_path, *JOB, "run.steps=6", "run.save_every=1", "trial=broken",
                       "reward_fn=faulty_reward:reward", timeout=300)
    assert time.monotonic() - started < 300
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("restage: error: rank ") and "ValueError: reward function broke on purpose" in last
    log = read_log(trial)
    # Each generating rank calls the reward once per step: the third call (step 3) raises.
    assert log.last_complete_step == 2
    assert (last_checkpoint(trial) / "manifest.json").is_file()


@pytest.mark.parametrize("override,message", [
    ("run.bogus=1", "run.bogus: unknown key"),
    ("run.steps=many", "run.steps: expected int, got 'many'"),
    ("dataset.path=data/nope.jsonl", "data/nope.jsonl"),
])
def test_bad_config_stops_before_any_rank_starts(tmp_path, override, message):
    done = restage_run(tmp_path, *JOB, "trial=bad", override, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "ppo-tiny" / "bad" / "log.h5").exists()


def test_schedule_for_more_ranks_than_started_is_refused(tmp_path):
    done = restage_run(tmp_path, *JOB, "trial=few", "-n", "1", timeout=120)
    assert done.returncode == 2
    assert "ranks:0-1" in done.stderr or "4" in done.stderr or "ranks" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
