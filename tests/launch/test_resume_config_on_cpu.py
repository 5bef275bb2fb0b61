"""--resume reads the YAML again: safe changes (steps, cadences, timeouts) apply with a line each, any other change is
refused with the diff, and a trial with every step done says how to go on (launch/resume.py)."""

import pytest

from restage.config.load import load_config
from restage.errors import ConfigError
from restage.launch.resume import Change, config_changes, is_safe, resumed_config, write_trial_overrides

YAML = """experiment: x
algorithm: ppo
models:
  actor: {path: a, trainable: true, optim: {lr: 1.0e-5, lr_schedule: LR_SCHEDULE}}
run: {steps: 4, batch_size: 8}
"""


@pytest.fixture
def trial(tmp_path):
    """A YAML and the trial dir a run of it with run.save_every=2 left (config.yaml and overrides.json)."""

    def make(lr_schedule="constant"):
        path = tmp_path / "job.yaml"
        path.write_text(YAML.replace("LR_SCHEDULE", lr_schedule))
        started = [f"run.results_dir={tmp_path}", "run.save_every=2"]
        cfg = load_config(path, started)
        cfg.trial_dir.mkdir(parents=True)
        (cfg.trial_dir / "config.yaml").write_text(cfg.to_yaml())
        write_trial_overrides(cfg.trial_dir, started)
        return path, cfg.trial_dir

    return make


def test_the_diff_names_each_changed_key():
    saved = {"run": {"steps": 4, "save_every": 2}, "models": {"actor": {"optim": {"lr": 1e-5}}}}
    new = {"run": {"steps": 8, "save_every": 2}, "models": {"actor": {"optim": {"lr": 2e-5}}, "ref": {"path": "r"}}}
    changes = config_changes(saved, new)
    assert [str(c) for c in changes] == ["run.steps 4 -> 8", "models.actor.optim.lr 1e-05 -> 2e-05",
                                        "models.ref (absent) -> {'path': 'r'}"]
    assert changes[0] == Change("run.steps", 4, 8)


def test_which_keys_are_safe():
    assert [k for k in ("run.steps", "run.save_every", "run.keep_checkpoints", "run.log_every", "run.stop_at_step",
                        "run.collective_timeout_seconds", "run.nonfinite", "run.save_before_end_seconds",
                        "slurm.time_minutes") if is_safe(k)] == [
        "run.steps", "run.save_every", "run.keep_checkpoints", "run.log_every", "run.stop_at_step",
        "run.collective_timeout_seconds", "run.nonfinite", "run.save_before_end_seconds", "slurm.time_minutes"]
    assert [k for k in ("run.batch_size", "run.micro_batches", "run.nprocs", "models.actor.optim.lr", "algo.kl_coef",
                        "dataset.path", "plan.mode", "seed", "generation.temperature", "slurm") if is_safe(k)] == []


def test_an_unchanged_yaml_resumes_the_saved_config(trial):
    path, trial_dir = trial()
    cfg, recorded, lines = resumed_config(path, [f"run.results_dir={trial_dir.parents[1]}"], trial_dir, saved_step=2)
    assert cfg == load_config(trial_dir / "config.yaml") and lines == []
    assert cfg.run.save_every == 2  # the trial's own override stays
    assert recorded == ["run.save_every=2", f"run.results_dir={trial_dir.parents[1]}"]


def test_an_edited_learning_rate_is_refused_with_the_diff(trial):
    path, trial_dir = trial()
    path.write_text(path.read_text().replace("lr: 1.0e-5", "lr: 3.0e-5"))
    with pytest.raises(ConfigError) as err:
        resumed_config(path, [f"run.results_dir={trial_dir.parents[1]}"], trial_dir, saved_step=2)
    assert str(err.value) == (
        "--resume cannot change models.actor.optim.lr 1e-05 -> 3e-05 (the checkpoint was trained with the old value); "
        "undo it, or start a new trial=NAME (on resume only run.steps, run.stop_at_step, run.save_every, "
        "run.keep_checkpoints, run.eval_every, run.log_every, run.startup_timeout_seconds, run.collective_timeout_seconds, "
        "run.peer_wait_timeout_seconds, run.activity_timeout_seconds, run.nonfinite, run.max_skipped_steps, "
        "run.save_before_end_seconds, slurm.* may change)")


def test_an_override_that_changes_the_batch_is_refused(trial):
    path, trial_dir = trial()
    with pytest.raises(ConfigError, match=r"^--resume cannot change run.batch_size 8 -> 16 \(the checkpoint"):
        resumed_config(path, [f"run.results_dir={trial_dir.parents[1]}", "run.batch_size=16"], trial_dir, 2)


def test_more_steps_and_a_new_cadence_apply_with_a_line_each(trial):
    path, trial_dir = trial()
    path.write_text(path.read_text().replace("steps: 4", "steps: 6"))
    cfg, recorded, lines = resumed_config(path, [f"run.results_dir={trial_dir.parents[1]}", "run.keep_checkpoints=5"],
                                          trial_dir, saved_step=4)
    assert (cfg.run.steps, cfg.run.keep_checkpoints, cfg.run.save_every) == (6, 5, 2)
    assert lines == ["restage: --resume applies run.steps 4 -> 6", "restage: --resume applies run.keep_checkpoints 2 -> 5"]
    assert recorded[-1] == "run.keep_checkpoints=5"


def test_more_steps_under_a_decaying_lr_schedule_says_the_schedule_stretches(trial):
    path, trial_dir = trial("cosine")
    _, _, lines = resumed_config(path, [f"run.results_dir={trial_dir.parents[1]}", "run.steps=8"], trial_dir, 4)
    assert lines == ["restage: --resume applies run.steps 4 -> 8",
                     "restage: the models.actor learning-rate schedule now spans 8 steps (its lr from step 4 on "
                     "changes with it)"]


def test_a_finished_trial_says_how_to_go_on(trial):
    path, trial_dir = trial()
    with pytest.raises(ConfigError) as err:
        resumed_config(path, [f"run.results_dir={trial_dir.parents[1]}"], trial_dir, saved_step=4)
    assert str(err.value) == (f"{trial_dir}: all 4 steps are done (checkpoint step-4); to train on, resume with a "
                              "larger run.steps (e.g. run.steps=8)")


def test_a_trial_without_recorded_overrides_takes_this_commands_overrides_on_its_saved_config(trial):
    path, trial_dir = trial()
    (trial_dir / "overrides.json").unlink()
    path.write_text(path.read_text().replace("lr: 1.0e-5", "lr: 3.0e-5"))  # not seen: the YAML's keys are unknown
    cfg, recorded, lines = resumed_config(path, ["run.steps=5"], trial_dir, saved_step=4)
    assert (cfg.run.steps, cfg.run.save_every, cfg.models["actor"].optim.lr) == (5, 2, 1e-5)
    assert recorded is None and lines == ["restage: --resume applies run.steps 4 -> 5"]


def test_a_trial_saved_with_run_nprocs_resumes_from_a_yaml_that_derives_it(tmp_path):
    """Trials from before run.nprocs defaulted to 0 (derived from the cluster) saved the number the YAML gave."""
    path = tmp_path / "job.yaml"
    path.write_text(YAML.replace("LR_SCHEDULE", "constant").replace("batch_size: 8", "batch_size: 8, nprocs: 2"))
    cfg = load_config(path, [f"run.results_dir={tmp_path}"])
    cfg.trial_dir.mkdir(parents=True)
    (cfg.trial_dir / "config.yaml").write_text(cfg.to_yaml())
    write_trial_overrides(cfg.trial_dir, [])
    path.write_text(YAML.replace("LR_SCHEDULE", "constant"))  # the YAML now leaves run.nprocs out
    resumed, _, lines = resumed_config(path, [f"run.results_dir={tmp_path}"], cfg.trial_dir, saved_step=2)
    assert resumed.run.nprocs == 2 and lines == []
