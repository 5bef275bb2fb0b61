"""`restage submit` runs a real several-rank job to completion as a SLURM job; bad input is one line."""

import json

import pytest
from slurm_jobs import (
    REAL_RANKS,
    REFERENCE_STEPS,
    SAVE_EVERY,
    by_hand,
    job_state,
    slurm_output,
    stats_by_step,
    submit,
    wait_finished,
)

from restage import cli
from restage.launch.trial import read_json
from restage.report.log import read_log
from restage.runtime.checkpoint import checkpoint_dir
from restage.schedule.file import read_schedule

pytestmark = pytest.mark.slurm
MFCS = {"actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train"}


def test_real_ppo_job_runs_every_rank_to_completion_with_a_complete_log(reference_run):
    reference_run.wait_completed()
    trial = reference_run.trial_dir
    schedule = read_schedule(trial / "schedule.json")  # planned inside the job, for its two ranks
    assert schedule.world_size == REAL_RANKS
    assert {m.mfc.name: (m.layout.strategy.dp, m.layout.strategy.tp) for m in schedule.mfcs}["actor_train"] == (1, 2)
    log = read_log(trial / "log.h5")
    assert (log.closed, log.world_size, log.last_complete_step, log.resumed_at_steps) == (
        True, REAL_RANKS, REFERENCE_STEPS, [])
    assert [int(s) for s in log.steps["step"]] == list(range(1, REFERENCE_STEPS + 1))  # every step, once, from 1
    assert (log.steps["samples"] == 32).all() and (log.steps["tokens"] > 0).all()
    for step in range(1, REFERENCE_STEPS + 1):  # both ranks ran every MFC, and the actor moved between layouts
        rows = log.mfcs[log.mfcs["step"] == step]
        assert {(str(r["name"]), int(r["rank"])) for r in rows} == {(m, r) for m in MFCS for r in range(REAL_RANKS)}
        moves = log.transfers[(log.transfers["step"] == step) & (log.transfers["kind"] == "realloc")]
        assert {str(n) for n in moves["name"]} == {"actor"} and moves["num_bytes"].sum() > 0
    stats = stats_by_step(log)
    assert sorted(stats) == list(range(1, REFERENCE_STEPS + 1))
    assert all({"actor_train/loss", "critic_train/loss", "actor_train/reward"} <= set(s) for s in stats.values())
    assert checkpoint_dir.complete_steps(trial) == [REFERENCE_STEPS - SAVE_EVERY, REFERENCE_STEPS]  # keeps 2
    attempts = read_json(trial / "job.json")["attempts"]
    job_id = reference_run.job_id
    assert [(a["job_id"], a["launcher"], a["outcome"]) for a in attempts] == [(job_id, "mpirun", "completed")]
    assert "restage.launch.rank restage.runtime.spmd" in attempts[0]["command"]
    out = slurm_output(trial)  # SLURM's output file lives in the trial directory
    assert f"step {REFERENCE_STEPS}/{REFERENCE_STEPS}" in out and "Job completed successfully" in out
    assert json.loads((trial / "submission.json").read_text())["program"] == "restage.runtime.spmd"
    assert job_state(job_id) == "COMPLETED"


def test_every_rank_lands_where_the_placement_says(selftest_config, tmp_path):
    """The runtime does not report where its ranks ran; the self-test program does (3 ranks, mpirun)."""
    ranks = 3
    config = selftest_config(cluster={"devices_per_node": ranks}, run={"steps": 2})
    job_id = submit(config)
    assert wait_finished(job_id) == "COMPLETED"
    result = read_json(tmp_path / "results" / "slurmtest" / "t" / "selftest.json")
    assert (result["world_size"], result["steps"], result["sum_torch"]) == (ranks, 2, by_hand(ranks, 2))
    assert sorted(p["rank"] for p in result["placements"]) == list(range(ranks))
    assert [p["local_rank"] for p in result["placements"]] == list(range(ranks))
    host = result["placements"][0]["host"]
    assert result["rendezvous"] == f"{host}:{20000 + int(job_id) % 20000}"  # the first host, the job's port


def test_unknown_partition_is_sbatchs_message_on_one_line(selftest_config, capsys):
    assert cli.main(["submit", str(selftest_config()), "slurm.partition=nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("restage: error: sbatch refused the job: invalid partition specified: nosuch")
    assert "Invalid partition name specified" in err
