"""`restage submit` runs a several-rank job to completion as a SLURM job; bad input is one line."""

import json

import pytest
from slurm_jobs import by_hand, job_state, slurm_output, submit, wait_finished

from restage import cli
from restage.launch.trial import read_json
from restage.report.log import read_log

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize("launcher,ranks", [("mpirun", 3), ("srun", 2)])
def test_submit_runs_every_rank_to_completion(selftest_config, tmp_path, launcher, ranks):
    config = selftest_config(cluster={"devices_per_node": ranks}, slurm={"launcher": launcher}, run={"steps": 5})
    job_id = submit(config)
    assert wait_finished(job_id) == "COMPLETED"
    trial = tmp_path / "results" / "slurmtest" / "t"
    result = read_json(trial / "selftest.json")
    assert (result["world_size"], result["steps"]) == (ranks, 5)
    assert result["sum_torch"] == result["sum_mpi"] == by_hand(ranks, 5)
    assert sorted(p["rank"] for p in result["placements"]) == list(range(ranks))
    assert [p["local_rank"] for p in result["placements"]] == list(range(ranks))
    host = result["placements"][0]["host"]
    assert result["rendezvous"] == f"{host}:{20000 + int(job_id) % 20000}"  # the first host, the job's port
    log = read_log(trial / "log.h5")  # complete: every step, cleanly closed
    assert (log.closed, log.last_complete_step, log.world_size) == (True, 5, ranks)
    assert [int(s) for s in log.steps["step"]] == [1, 2, 3, 4, 5]
    attempts = read_json(trial / "job.json")["attempts"]
    assert [(a["job_id"], a["launcher"], a["outcome"]) for a in attempts] == [(job_id, launcher, "completed")]
    assert attempts[0]["command"].split()[0].endswith(launcher)
    out = slurm_output(trial)  # SLURM's output file lives in the trial directory
    assert f"selftest: {ranks} ranks, 5 steps" in out and "Job completed successfully" in out
    assert json.loads((trial / "submission.json").read_text())["world_size"] == ranks
    assert job_state(job_id) == "COMPLETED"


def test_unknown_partition_is_sbatchs_message_on_one_line(selftest_config, capsys):
    assert cli.main(["submit", str(selftest_config()), "slurm.partition=nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("restage: error: sbatch refused the job: invalid partition specified: nosuch")
    assert "Invalid partition name specified" in err
