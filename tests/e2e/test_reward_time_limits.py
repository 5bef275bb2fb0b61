"""A rule reward that never returns, under `restage run` with `rewards.timeout_seconds`, in sync and async mode: the
step ends within the limit, one stderr line names the reward and the samples, and the log counts the answers.

Before the limit existed, the same command (`reward_fn=hanging_reward:forever`) never ended.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest
from e2e_jobs import ROOT, TINY, tiny_model

from restage.report.log import read_log

pytestmark = [pytest.mark.e2e]
PATHS = [f"models.actor.path={TINY}", f"models.ref.path={TINY}", f"dataset.path={ROOT}/data/synthetic/prompts.jsonl",
         f"dataset.tokenizer={ROOT}/data/synthetic/tokenizer"]
LINE = (r"restage: reward {name}: samples? [\d, ]+(, \.\.\. \(\d+ samples\))? did not return within {limit} \((\d+) "
        r"of 64 answers\); scored 0 \(rewards.on_timeout=stop stops the run instead\)")


def run_hanging(tmp_path, nprocs: int, trial: str, *overrides: str) -> tuple[subprocess.CompletedProcess, float]:
    tiny_model()
    command = [sys.executable, "-m", "restage.cli", "run", "jobs/grpo_tiny.yaml", "-n", str(nprocs), f"trial={trial}",
               f"run.results_dir={tmp_path}", *PATHS, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "algorithms")])}
    began = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - began
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done, seconds


def test_a_batched_reward_that_never_returns_ends_at_its_limit_in_sync_mode(tmp_path):
    done, seconds = run_hanging(tmp_path, 1, "sync", "run.steps=2", "reward_fn=hanging_reward:forever",
                                "rewards.timeout_seconds=2")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("restage: reward forever")]
    assert len(lines) == 2, done.stderr[-3000:]
    for line in lines:
        match = re.fullmatch(LINE.format(name="forever", limit=r"rewards.timeout_seconds=2"), line)
        assert match and match.group(2) == "64", line
    stats = read_log(tmp_path / "grpo-tiny" / "sync").stat_series()
    np.testing.assert_array_equal(stats["actor_gen/reward_timed_out"][1], [1.0, 1.0])
    np.testing.assert_array_equal(stats["actor_train/reward"][1], [0.0, 0.0])
    print(f"sync: 2 steps with a hanging reward in {seconds:.1f} s: {lines[0]}")


@pytest.mark.multirank
def test_a_per_sample_reward_that_hangs_on_some_samples_ends_at_the_batch_limit_in_async_mode(tmp_path):
    done, seconds = run_hanging(tmp_path, 2, "async", "plan.execution=async", "run.steps=2",
                                "reward_fn=hanging_reward:hangs_on_nine", "rewards.timeout_seconds=1",
                                "rewards.batch_timeout_seconds=3")
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("restage: reward hangs_on_nine")]
    assert len(lines) == 2, done.stderr[-3000:]
    limits = r"(rewards.timeout_seconds=1|rewards.batch_timeout_seconds=3( or rewards.timeout_seconds=1)?)"
    counts = []
    for line in lines:
        match = re.fullmatch(LINE.format(name="hangs_on_nine", limit=limits), line)
        assert match, line
        counts.append(int(match.group(4)))
    stats = read_log(tmp_path / "grpo-tiny" / "async").stat_series()
    np.testing.assert_array_equal(stats["actor_gen/reward_timed_out"][1], np.array(counts) / 64)
    # every answer not timed out scored 1: the step's mean reward is the other share
    np.testing.assert_allclose(stats["actor_train/reward"][1], 1 - np.array(counts) / 64, rtol=0, atol=1e-6)
    print(f"async: 2 steps with a reward hanging on some samples in {seconds:.1f} s: {lines[0]}")
