"""A config's relative paths: the file's against its directory, the command line's against the working directory,
a sweep's against the sweep file's; the shipped jobs load the same from any directory."""

import contextlib
from pathlib import Path

import pytest
import yaml

from restage.config.load import load_config
from restage.errors import ConfigError, hub_hint
from restage.launch.sweep import load_sweep

REPO = Path(__file__).resolve().parents[2]
JOBS = sorted((REPO / "jobs").glob("*.yaml")) + sorted((REPO / "jobs" / "paper").glob("*.yaml"))


def _write(path: Path, **extra) -> Path:
    data = {"experiment": "x", "algorithm": "sft", "models": {"actor": {"path": "ckpt", "trainable": True}},
            "dataset": {"path": "data/train.jsonl", "tokenizer": "../tok", "eval_path": "/abs/eval.jsonl"},
            "cluster": {"name": "local-cpu"}, "slurm": {"template": "site.sh"}, **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_files_paths_are_relative_to_its_directory_and_the_command_lines_to_the_working_one(tmp_path, monkeypatch):
    config = _write(tmp_path / "project" / "jobs" / "job.yaml")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Path("project/jobs/job.yaml"), ["models.ref.path=mine", "dataset.tokenizer=tok2"])
    here = tmp_path / "project" / "jobs"
    assert cfg.models["actor"].path == str(here / "ckpt")
    assert (cfg.dataset.path, cfg.dataset.eval_path) == (str(here / "data" / "train.jsonl"), "/abs/eval.jsonl")
    assert cfg.dataset.tokenizer == str(tmp_path / "tok2")  # the override's: against the working directory
    assert cfg.models["ref"].path == str(tmp_path / "mine")
    assert cfg.trial_dir == here / "results" / "x" / "default"  # run.results_dir left out: beside the file
    assert (cfg.cluster.name, cfg.slurm.template) == ("local-cpu", str(here / "site.sh"))  # a name stays a name
    monkeypatch.chdir(config.parent)
    assert load_config("job.yaml", ["models.ref.path=mine", "dataset.tokenizer=tok2"]).models["actor"] == \
        cfg.models["actor"]


@pytest.mark.parametrize("job", JOBS, ids=lambda p: str(p.relative_to(REPO / "jobs")))
def test_every_shipped_job_loads_the_same_from_any_directory(job, tmp_path):
    with contextlib.chdir(REPO):
        here = load_config(job)
    with contextlib.chdir(tmp_path):
        there = load_config(job)
    assert here == there
    assert here.trial_dir == REPO / "results" / here.experiment / "default"
    for spec in here.models.values():
        assert not spec.path or Path(spec.path).is_relative_to(REPO / "results" / "assets")
    if here.dataset.path:
        assert Path(here.dataset.path).is_file() and Path(here.dataset.tokenizer).is_dir()


def test_a_sweeps_paths_are_relative_to_the_sweep_file_and_its_bases_to_the_base(tmp_path):
    _write(tmp_path / "jobs" / "base.yaml")
    sweep = tmp_path / "sweeps" / "s.yaml"
    sweep.parent.mkdir()
    sweep.write_text(yaml.safe_dump({"base": "../jobs/base.yaml", "overrides": ["dataset.tokenizer=tok"],
                                     "grid": {"models.actor.path": ["a", "/abs/b"]}}))
    _, trials = load_sweep(sweep)
    assert [t.config.models["actor"].path for t in trials] == [str(tmp_path / "sweeps" / "a"), "/abs/b"]
    assert {t.config.dataset.tokenizer for t in trials} == {str(tmp_path / "sweeps" / "tok")}
    assert {t.config.dataset.path for t in trials} == {str(tmp_path / "jobs" / "data" / "train.jsonl")}
    assert trials[0].config.trial_dir.parent == tmp_path / "jobs" / "results" / "x" / "s"


def test_a_missing_path_is_named_absolute_and_a_hub_id_still_gets_its_hint(tmp_path, monkeypatch):
    from restage.models.arch import ModelConfig

    config = _write(tmp_path / "cfg" / "job.yaml", models={"actor": {"path": "assets/qwen3", "trainable": True},
                                                            "ref": {"path": "Qwen/Qwen3-0.6B"}})
    (config.parent / "assets").mkdir()  # a local directory, not a hub owner: no hint
    monkeypatch.chdir(tmp_path)
    cfg = load_config(config)
    with pytest.raises(Exception) as err:
        ModelConfig.from_pretrained(cfg.models["actor"].path)
    assert str(tmp_path / "cfg" / "assets" / "qwen3") in str(err.value)
    assert "hub id" in hub_hint(cfg.models["ref"].path) and "'Qwen/Qwen3-0.6B'" in hub_hint(cfg.models["ref"].path)
    assert hub_hint(cfg.models["actor"].path) == hub_hint(str(tmp_path / "no" / "results" / "assets" / "x")) == ""
    with pytest.raises(ConfigError, match=f"config file {tmp_path / 'nope.yaml'} does not exist"):
        load_config("nope.yaml")


def test_a_trial_saved_with_paths_relative_to_its_run_directory_still_resumes(tmp_path, monkeypatch):
    """A trial from before this rule saved the paths as given (relative to where it ran): read against the working
    directory, they equal the job's own, so a resume finds no change."""
    from restage.launch.resume import resumed_config, saved_config

    job = _write(tmp_path / "jobs" / "job.yaml", models={"actor": {"path": "../ckpt", "trainable": True}},
                 dataset={"path": "../data/train.jsonl"}, run={"results_dir": "../results", "steps": 4})
    trial = tmp_path / "results" / "x" / "default"
    trial.mkdir(parents=True)
    old = load_config(job).to_dict()
    old["models"]["actor"]["path"], old["dataset"]["path"], old["run"]["results_dir"] = "ckpt", "data/train.jsonl", \
        "results"
    (trial / "config.yaml").write_text(yaml.safe_dump(old))
    (trial / "overrides.json").write_text("[]")  # the YAML is read again and compared
    monkeypatch.chdir(tmp_path)  # where that trial ran
    assert saved_config(trial).models["actor"].path == str(tmp_path / "ckpt")
    cfg, _, lines = resumed_config(job, [], trial, saved_step=2)
    assert lines == [] and cfg.dataset.path == str(tmp_path / "data" / "train.jsonl")


def test_the_trial_records_a_path_override_absolute(tmp_path):
    from restage.config.paths import absolute_override

    assert absolute_override("dataset.path=b/q.parquet", tmp_path) == f"dataset.path={tmp_path / 'b' / 'q.parquet'}"
    assert absolute_override("models.actor.path=ckpt", tmp_path) == f"models.actor.path={tmp_path / 'ckpt'}"
    assert absolute_override("cluster.name=mine.yaml", tmp_path) == f"cluster.name={tmp_path / 'mine.yaml'}"
    for kept in ("cluster.name=h100-80gb", "run.steps=4", "dataset.path=/abs/q.jsonl", "dataset.fields.prompt=q"):
        assert absolute_override(kept, tmp_path) == kept
