"""A 2-trial sweep of real jobs is one SLURM job array; each trial is planned in its job, finishes with its
own log, and the index lists them. The trials use the srun launcher (PMIx), the reference job mpirun."""

import contextlib

import pytest
import yaml
from slurm_jobs import REAL_RANKS, REPO, failure_report, real_overrides, wait_finished

from restage import cli
from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.schedule.file import read_schedule

pytestmark = pytest.mark.slurm


def test_two_trial_sweep_of_real_jobs_is_one_job_array(tiny_model, tmp_path, capsys):
    results = tmp_path / "results"
    overrides = [o for o in real_overrides(results, "unused") if not o.startswith("trial=")]
    overrides += ["slurm.launcher=srun", "plan.mode=search", "plan.time_budget_seconds=10"]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(REPO / "jobs" / "grpo_tiny.yaml"), "name": "sw",
                                     "overrides": overrides, "grid": {"run.steps": [2, 3]}}))
    with contextlib.chdir(REPO):  # the shipped job's relative paths, as a user in the repository gives them
        assert cli.main(["sweep", str(sweep)]) == 0
    sweep_dir = results / "grpo-tiny" / "sw"
    trials = read_json(sweep_dir / "index.json")["trials"]
    assert [t["trial"] for t in trials] == ["sw/000", "sw/001"]
    assert [t["values"] for t in trials] == [{"run.steps": 2}, {"run.steps": 3}]
    assert len({t["job_id"].split("_")[0] for t in trials}) == 1  # one array ...
    assert sorted(t["job_id"].split("_")[1] for t in trials) == ["0", "1"]  # ... of two tasks
    for t in trials:
        state = wait_finished(t["job_id"])
        assert state == "COMPLETED", f"{t['trial']} {state}:\n{failure_report(sweep_dir / t['trial'].split('/')[1])}"
    for t, steps in zip(trials, (2, 3)):
        trial_dir = sweep_dir / t["trial"].split("/")[1]
        assert trial_dir == type(trial_dir)(t["trial_dir"])
        log = read_log(trial_dir / "log.h5")  # its own log, with its own number of steps
        assert (log.closed, log.world_size, [int(s) for s in log.steps["step"]]) == (True, REAL_RANKS, list(range(1, steps + 1)))
        assert yaml.safe_load(log.config)["trial"] == t["trial"]
        assert read_schedule(trial_dir / "schedule.json").world_size == REAL_RANKS  # planned by restage sweep
        attempts = read_json(trial_dir / "job.json")["attempts"]
        array_task = [(f"{a['array_job_id']}_{a['array_task_id']}", a["launcher"], a["outcome"]) for a in attempts]
        assert array_task == [(t["job_id"], "srun", "completed")]
    capsys.readouterr()
    assert cli.main(["status", str(sweep_dir)]) == 0
    out = capsys.readouterr().out
    assert out.count("COMPLETED") == 2 and "sw/000" in out and "sw/001" in out
