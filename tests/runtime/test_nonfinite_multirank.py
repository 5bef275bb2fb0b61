"""A NaN reward never reaches the weights: the step's training is skipped on every rank (or the run stops), every
checkpoint stays finite, and a reward that is always NaN ends the run instead of exiting 0."""

import math

import pytest
import torch
from runs import hf_weights, last_checkpoint, restage_run

from restage.report.log import read_log
from restage.runtime.checkpoint import checkpoint_dir

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=4", "run.save_every=1", "run.keep_checkpoints=9",
       "plan.mode=manual",
       "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
       "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2",
       "plan.layouts.critic_train=ranks:0-1 dp2"]


def _all_finite(trial) -> list[str]:
    """Every checkpoint of the trial, each of whose trained models holds only finite weights."""
    out = []
    for step in sorted(checkpoint_dir.checkpoints_root(trial).glob("step-*")):
        for model in ("actor", "critic"):
            weights = hf_weights(step / model / "hf")
            assert weights and all(bool(torch.isfinite(w.float()).all()) for w in weights.values()), (step, model)
        out.append(step.name)
    return out


def test_a_nan_reward_skips_that_steps_training(tmp_path):
    trial = tmp_path / "ppo-tiny" / "skip"
    done = restage_run(tmp_path, *JOB, "trial=skip", "reward_fn=nan_reward:reward", timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warned = [line for line in done.stdout.splitlines() if "non-finite" in line]
    # Each rank holding the bad sample names it: both TP ranks of actor_train, critic_train's DP rank 0.
    assert len(warned) == 3 and all(line.startswith("restage: step 2: ") for line in warned), warned
    assert len({line.split(" in samples ")[1].split(" on rank")[0] for line in warned}) == 1  # one sample id
    assert sorted(line.split(": ")[2] for line in warned) == ["actor_train", "actor_train", "critic_train"]
    assert all(": non-finite rewards in samples [" in line for line in warned)
    log = read_log(trial)
    series = log.stat_series()
    assert list(series["actor_train/skipped_nonfinite"][0]) == [2] == list(series["critic_train/skipped_nonfinite"][0])
    assert log.last_complete_step == 4
    assert _all_finite(trial) == ["step-1", "step-2", "step-3", "step-4"]
    losses = series["actor_train/loss"][1]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)  # steps 1, 3, 4 trained


def test_nonfinite_stop_ends_the_run_and_keeps_the_finite_checkpoints(tmp_path):
    trial = tmp_path / "ppo-tiny" / "stop"
    done = restage_run(tmp_path, *JOB, "trial=stop", "reward_fn=nan_reward:reward", "run.nonfinite=stop", timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "NonFiniteError: step 2: " in last and "set run.nonfinite=skip" in last, done.stderr[-2000:]
    assert read_log(trial).last_complete_step == 1
    assert _all_finite(trial) == ["step-1"] and last_checkpoint(trial).name == "step-1"


def test_a_reward_that_is_always_nan_stops_the_run(tmp_path):
    trial = tmp_path / "ppo-tiny" / "always"
    done = restage_run(tmp_path, *JOB, "trial=always", "reward_fn=nan_reward:always_nan", "run.max_skipped_steps=2",
                       timeout=300)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "step 2: " in last and "non-finite inputs in 2 steps in a row (run.max_skipped_steps=2)" in last, last
    assert _all_finite(trial) == ["step-1"]


def test_resume_from_a_nonfinite_checkpoint_names_the_newest_finite_one(tmp_path):
    trial = tmp_path / "ppo-tiny" / "resume"
    done = restage_run(tmp_path, *JOB, "trial=resume", "run.steps=2", timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    newest = last_checkpoint(trial)
    assert newest.name == "step-2"
    # The actor trains with dp 1 (tp2: ZeRO runs as stage 0), so its weights load from the engine's module files.
    files = sorted((newest / "actor" / "engine" / "state").glob("mp_rank_*_model_states.pt"))
    assert len(files) == 2
    for file in files:
        state = torch.load(file, weights_only=False)
        name = next(k for k, v in state["module"].items() if v.is_floating_point())
        state["module"][name].fill_(float("nan"))
        torch.save(state, file)
    resumed = restage_run(tmp_path, "jobs/ppo_tiny.yaml", "-n", "2", "trial=resume", "run.steps=3", "--resume",
                          timeout=300)
    assert resumed.returncode != 0
    last = resumed.stderr.strip().splitlines()[-1]
    assert (f"CheckpointError: {newest}: holds non-finite weights; the newest finite checkpoint is step-1: rename "
            f"step-2 in {trial / 'checkpoints'} (e.g. to step-2.nonfinite) to resume from it") in last, last
