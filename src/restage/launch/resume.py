"""``restage run --resume``: the config a resumed trial continues with.

The trial's saved config (``<trial>/config.yaml``) is the base. The YAML is read again with the
overrides the trial was run with (``<trial>/overrides.json``) and this command's own; every key
that then differs from the saved config is a change. Changes to keys in ``SAFE_ON_RESUME`` (how
long to run, when to checkpoint, timeouts, the non-finite policy, SLURM settings) apply, each named
in one line; any other change (a learning rate, a model, the data, the plan, the algorithm) would
not continue the same training, so it is refused with the diff. A trial from before
``overrides.json`` was written is compared with this command's overrides only.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from restage.config.load import apply_override, config_from_dict, load_config
from restage.config.paths import absolute_override, resolve_paths
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError

TRIAL_KEYS = ("experiment", "trial", "run.results_dir")  # they pick the trial; they are not changes to it
# Keys a resume may change: none of them alters what a step computes, only how many steps run and
# how the run is kept and watched. Entries ending in "." cover a whole section.
SAFE_ON_RESUME = ("run.steps", "run.stop_at_step", "run.save_every", "run.keep_checkpoints", "run.eval_every",
                  "run.log_every", "run.startup_timeout_seconds", "run.collective_timeout_seconds", "run.peer_wait_timeout_seconds",
                  "run.activity_timeout_seconds", "run.nonfinite", "run.max_skipped_steps", "run.save_before_end_seconds", "slurm.")
OVERRIDES_FILE = "overrides.json"


class _Absent:
    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


@dataclass(frozen=True)
class Change:
    key: str  # dotted
    old: object
    new: object

    def __str__(self) -> str:
        return f"{self.key} {self.old!r} -> {self.new!r}"


def is_safe(key: str) -> bool:
    return any(key == safe or (safe.endswith(".") and key.startswith(safe)) for safe in SAFE_ON_RESUME)


def config_changes(saved: dict, new: dict, prefix: str = "") -> list[Change]:
    """Every dotted key whose value differs between two plain config mappings, in key order."""
    out = []
    for key in [*saved, *(k for k in new if k not in saved)]:
        where = f"{prefix}{key}"
        old, value = saved.get(key, ABSENT), new.get(key, ABSENT)
        if isinstance(old, dict) and isinstance(value, dict):
            out += config_changes(old, value, f"{where}.")
        elif old != value:
            out.append(Change(where, old, value))
    return out


def trial_overrides(trial_dir: Path) -> list[str] | None:
    """The overrides the trial's config was made with (None: the trial predates the record)."""
    path = trial_dir / OVERRIDES_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def write_trial_overrides(trial_dir: Path, overrides: list[str]) -> None:
    kept = [absolute_override(o, Path.cwd()) for o in overrides if o.split("=", 1)[0].strip() not in TRIAL_KEYS]
    (trial_dir / OVERRIDES_FILE).write_text(json.dumps(kept, indent=1) + "\n")


def saved_config(trial_dir: Path) -> ExperimentConfig:
    """The trial's ``config.yaml``. Its paths are absolute; a trial saved before paths were resolved against the
    config file (config/paths.py) holds them relative to the directory it ran in, which this one is taken to be."""
    path = trial_dir / "config.yaml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return load_config(path)  # its one-line error
    resolve_paths(data, Path.cwd())
    return config_from_dict(data)


def resumed_config(config_path: str | Path, overrides: list[str], trial_dir: Path,
                   saved_step: int) -> tuple[ExperimentConfig, list[str] | None, list[str]]:
    """(the config to continue with, the overrides that make it from the YAML or None where unknown, one line
    per applied change).

    ``saved_step``: the step of the checkpoint the run continues from. Refuses (ConfigError) a change
    outside ``SAFE_ON_RESUME`` with the diff, and a run with no steps left to do.
    """
    saved = saved_config(trial_dir)
    earlier = trial_overrides(trial_dir)
    if earlier is None:  # which keys the YAML gave is unknown: this command's overrides on the saved config
        data = saved.to_dict()
        for override in overrides:
            apply_override(data, override)
        resolve_paths(data, Path.cwd())  # an override's path: against the working directory, as load_config does
        requested = config_from_dict(data)
    else:
        requested = load_config(config_path, [*earlier, *overrides])
    if requested.run.nprocs == 0 and saved.run.nprocs:  # 0 derives it from the cluster: a trial saved with a number
        requested = dataclasses.replace(requested, run=dataclasses.replace(requested.run, nprocs=saved.run.nprocs))
    changes = [c for c in config_changes(saved.to_dict(), requested.to_dict()) if c.key not in TRIAL_KEYS]
    refused = [c for c in changes if not is_safe(c.key)]
    if refused:
        raise ConfigError(f"--resume cannot change {'; '.join(map(str, refused))} (the checkpoint was trained "
                          f"with the old value); undo it, or start a new trial=NAME (on resume only "
                          f"{', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in SAFE_ON_RESUME)} "
                          "may change)")
    if requested.run.steps <= saved_step:
        raise ConfigError(f"{trial_dir}: all {requested.run.steps} steps are done (checkpoint step-{saved_step}); "
                          f"to train on, resume with a larger run.steps (e.g. run.steps={2 * saved_step})")
    lines = [f"restage: --resume applies {c}" for c in changes]
    if any(c.key == "run.steps" for c in changes):
        decaying = sorted(f"models.{name}" for name, spec in requested.models.items()
                          if spec.trainable and spec.optim.lr_schedule != "constant")
        if decaying:
            lines.append(f"restage: the {', '.join(decaying)} learning-rate schedule now spans "
                         f"{requested.run.steps} steps (its lr from step {saved_step} on changes with it)")
    return requested, (None if earlier is None else [*earlier, *overrides]), lines
