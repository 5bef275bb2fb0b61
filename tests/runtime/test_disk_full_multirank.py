"""A disk that fills during a run (a real small tmpfs): the run ends in one line naming the place and the write,
fast, and every earlier checkpoint and log step stays whole and loadable."""

from __future__ import annotations

import re
import time

import pytest
from runs import restage_run

from restage.report.log import read_log
from restage.runtime.checkpoint.checkpoint_dir import complete_steps, final_dir
from restage.runtime.checkpoint.run_state import safe_load

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

TWO_LAYOUTS = ["-n", "2", "plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
               "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2",
               "plan.layouts.critic_train=ranks:0-1 dp2"]
JOB = ["jobs/ppo_tiny.yaml", "run.batch_size=8", "run.steps=8", "run.save_every=2", "run.keep_checkpoints=10",
       "reward_fn=disk_filler:reward", *TWO_LAYOUTS]
EXIT_SECONDS = 60  # from the fill to the launcher's exit


@pytest.mark.parametrize("case", [
    # Filled with nothing left during step 3: the master's log write of step 3 fails (steps count from 1).
    {"fill_at": 3, "leave_bytes": 0, "what": "the run log \\(step 3\\) \\(\\S+/log\\.h5\\.journal\\)", "log_steps": 2},
    # Filled during step 4 leaving 1 MiB: step 4's log line fits, checkpoint step-4 (about 2.5 MB) does not.
    {"fill_at": 4, "leave_bytes": 1 << 20, "what": "checkpoint step-4 \\(\\S+/checkpoints\\)", "log_steps": 4},
], ids=["log", "checkpoint"])
def test_a_disk_filling_mid_run_ends_it_in_one_line_and_keeps_everything_before(tmp_path, small_tmpfs, case):
    disk = small_tmpfs(48 << 20)
    stamp = tmp_path / "filled-at"
    env = {"RESTAGE_TEST_FILL_DIR": str(disk), "RESTAGE_TEST_FILL_AT": str(case["fill_at"]),
           "RESTAGE_TEST_FILL_LEAVE_BYTES": str(case["leave_bytes"]), "RESTAGE_TEST_FILL_STAMP": str(stamp)}
    done = restage_run(disk / "results", *JOB, "trial=full", env=env, timeout=600)
    ended = time.time()
    trial = disk / "results" / "ppo-tiny" / "full"
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    print(f"{ended - float(stamp.read_text()):.1f} s from the fill to the exit; {last}")
    assert ended - float(stamp.read_text()) < EXIT_SECONDS
    steps = case["log_steps"]
    pattern = (f"restage: error: no space left on {disk} \\(tmpfs\\) while writing {case['what']}; free space there "
               f"\\(or move run.results_dir\\) and --resume \\(rank [01]\\); kept: log steps 1..{steps}, "
               "checkpoints step-2")
    assert re.fullmatch(pattern, last), last

    log = read_log(trial)  # every step before the failed write, whole
    assert log.last_complete_step == steps and log.steps["step"].tolist() == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        rows = log.mfcs[log.mfcs["step"] == step]
        assert sorted(set(rows["rank"].tolist())) == [0, 1] and len(set(rows["name"].tolist())) == 5
    assert log.stat_series()["actor_train/loss"][0].tolist() == list(range(1, steps + 1))

    assert complete_steps(trial) == [2]  # the checkpoint before the failure, whole and loadable
    from transformers import AutoModelForCausalLM

    checkpoint = final_dir(trial, 2)
    for model in ("actor", "critic"):
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint / model / "hf")
        assert sum(p.numel() for p in loaded.parameters()) > 0
    for rank in (0, 1):
        assert "torch" in safe_load(checkpoint / "ranks" / f"rank{rank}.pt")
