"""Two runs started on one trial: the second is refused at once, in one line naming the first; the first finishes
with its own seed, log and checkpoints."""

import time

import pytest
from runs import last_checkpoint, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=3", "run.save_every=1", "trial=shared"]


def test_a_second_run_on_a_trial_in_use_is_refused(tmp_path):
    trial = tmp_path / "ppo-tiny" / "shared"
    first = restage_run(tmp_path, *JOB, "seed=1", wait=False)
    deadline = time.monotonic() + 120
    while not (trial / "schedule.json").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (trial / "schedule.json").is_file(), "the first run never planned"
    schedule = (trial / "schedule.json").read_bytes()
    started = time.monotonic()
    second = restage_run(tmp_path, *JOB, "seed=2", "--overwrite", timeout=120)
    assert time.monotonic() - started < 30
    assert second.returncode != 0
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{trial} is in use by pid {first.pid} on " in lines[0], second.stderr
    assert (trial / "schedule.json").read_bytes() == schedule  # nothing of the first run was touched
    output, _ = first.communicate(timeout=600)
    assert first.returncode == 0, output[-3000:]
    assert read_log(trial).last_complete_step == 3
    assert (last_checkpoint(trial) / "manifest.json").is_file()
    assert "seed: 1" in (trial / "config.yaml").read_text()
