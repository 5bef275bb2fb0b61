"""A 2-trial sweep is one SLURM job array; each trial has its own directory and outputs; the index lists them."""

import pytest
import yaml
from slurm_jobs import by_hand, wait_finished

from restage import cli
from restage.launch.trial import read_json

pytestmark = pytest.mark.slurm


def test_two_trial_sweep_is_one_job_array(selftest_config, tmp_path, capsys):
    base = selftest_config("base.yaml", cluster={"devices_per_node": 2})
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": base.name, "name": "sw", "grid": {"run.steps": [3, 5]}}))
    assert cli.main(["sweep", str(sweep)]) == 0
    index = read_json(tmp_path / "results" / "slurmtest" / "sw" / "index.json")
    trials = index["trials"]
    assert [t["trial"] for t in trials] == ["sw/000", "sw/001"]
    assert [t["values"] for t in trials] == [{"run.steps": 3}, {"run.steps": 5}]
    array_ids = {t["job_id"].split("_")[0] for t in trials}
    assert len(array_ids) == 1  # one array
    assert sorted(t["job_id"].split("_")[1] for t in trials) == ["0", "1"]
    for t in trials:
        assert wait_finished(t["job_id"]) == "COMPLETED"
    for t, steps in zip(trials, (3, 5)):
        result = read_json(tmp_path / "results" / "slurmtest" / "sw" / t["trial"].split("/")[1] / "selftest.json")
        assert (result["steps"], result["world_size"]) == (steps, 2)
        assert result["sum_torch"] == by_hand(2, steps)
    capsys.readouterr()
    assert cli.main(["status", str(tmp_path / "results" / "slurmtest" / "sw")]) == 0
    out = capsys.readouterr().out
    assert out.count("COMPLETED") == 2 and "sw/000" in out and "sw/001" in out
