import pytest
import yaml

from restage import cli
from restage.errors import ConfigError
from restage.launch.geometry import job_geometry
from restage.launch.sweep import check_config_key, load_sweep


def sweep_file(tmp_path, write_config, **spec):
    base = write_config("base.yaml")
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": base.name, "name": "sw", **spec}))
    return path


def test_grid_times_zip(tmp_path, write_config):
    path = sweep_file(tmp_path, write_config, overrides=["run.steps=7"],
                      grid={"run.batch_size": [4, 8], "models.actor.optim.lr": [1e-3, 2e-3]},
                      zip={"seed": [1, 2, 3], "algo.kl": [0.1, 0.2, 0.3]})
    name, trials = load_sweep(path)
    assert name == "sw" and len(trials) == 2 * 2 * 3
    assert [t.config.trial for t in trials[:2]] == ["sw/000", "sw/001"]
    first, last = trials[0], trials[-1]
    assert first.values == {"run.batch_size": 4, "models.actor.optim.lr": 1e-3, "seed": 1, "algo.kl": 0.1}
    assert last.values == {"run.batch_size": 8, "models.actor.optim.lr": 2e-3, "seed": 3, "algo.kl": 0.3}
    assert (last.config.run.batch_size, last.config.models["actor"].optim.lr, last.config.seed) == (8, 2e-3, 3)
    assert all(t.config.run.steps == 7 for t in trials)
    assert len({str(t.config.trial_dir) for t in trials}) == 12


def test_each_trial_gets_its_own_cluster_size(tmp_path, write_config):
    path = sweep_file(tmp_path, write_config, grid={"cluster.nodes": [1, 2, 4]})
    _, trials = load_sweep(path)
    assert [job_geometry(t.config).world_size for t in trials] == [3, 6, 12]


@pytest.mark.parametrize("key,message", [
    ("run.stepz", "sweep key 'run.stepz' is not a config key: run has no 'stepz'"),
    ("learning_rate", "sweep key 'learning_rate' is not a config key: the top level has no 'learning_rate'"),
    ("run.steps.x", "sweep key 'run.steps.x' is not a config key: run.steps is a value"),
    ("models.actor.lr", "sweep key 'models.actor.lr' is not a config key: models.actor has no 'lr'"),
])
def test_unknown_key_is_named(key, message):
    with pytest.raises(ConfigError) as err:
        check_config_key(key)
    assert str(err.value).startswith(message)


def test_free_form_sections_accept_any_key():
    for key in ("algo.anything", "slurm.template_vars.cuda_module", "models.critic.path", "plan.layouts.actor_gen"):
        check_config_key(key)


def test_bad_sweep_key_is_one_line_from_the_cli(tmp_path, write_config, capsys):
    path = sweep_file(tmp_path, write_config, grid={"run.stepz": [1, 2]})
    assert cli.main(["sweep", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "sweep key 'run.stepz' is not a config key" in err


def test_invalid_values_name_the_trial(tmp_path, write_config):
    path = sweep_file(tmp_path, write_config, grid={"run.steps": [2, "many"]})
    with pytest.raises(ConfigError, match=r"sweep trial 1 \(\{'run.steps': 'many'\}\): run.steps: expected int"):
        load_sweep(path)


def test_zip_lengths_must_agree(tmp_path, write_config):
    path = sweep_file(tmp_path, write_config, zip={"seed": [1, 2], "run.steps": [1]})
    with pytest.raises(ConfigError, match="zip lists must have equal lengths"):
        load_sweep(path)


def test_dry_run_one_array_and_one_per_allocation(tmp_path, write_config, capsys):
    same = sweep_file(tmp_path, write_config, grid={"run.steps": [2, 3]})
    assert cli.main(["sweep", str(same), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("#SBATCH --array=0-1%2") == 1 and out.count("#!/bin/bash") == 1
    resized = sweep_file(tmp_path, write_config, grid={"cluster.nodes": [1, 2]})
    assert cli.main(["sweep", str(resized), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("#!/bin/bash") == 2
    assert "#SBATCH --nodes=1" in out and "#SBATCH --nodes=2" in out
    assert not (tmp_path / "results").exists()  # a dry run writes nothing
