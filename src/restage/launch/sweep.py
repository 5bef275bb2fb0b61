"""``restage sweep SWEEP.yaml [--dry-run]``: a grid (and zip) over config keys as one SLURM job array.

::

    base: ppo_tiny.yaml          # experiment config, relative to this file (its own paths: to its directory)
    name: lr-sweep               # the sweep's directory: results/<experiment>/<name>/
    overrides: [run.steps=20]    # optional, applied to every trial (a list of key=value or a mapping)
    grid:                        # every combination...
      models.actor.optim.lr: [1.0e-5, 2.0e-5]
    zip:                         # ...times these lists taken together (equal lengths)
      seed: [1, 2]
      run.batch_size: [8, 16]

Trial ``i`` is ``results/<experiment>/<name>/<i:03d>/`` (config ``trial = <name>/<i:03d>``). Every trial is
checked as ``restage submit`` checks a job (``launch.checks.validate``: models, data set, its own plan for its own
cluster size) before anything is queued, ``--dry-run`` included; a trial that fails is named in the one-line error,
and the plan that was checked is the one its job runs. ``index.json`` in the sweep directory lists
every trial: its number, directory, swept values and SLURM job id. Trials whose sbatch resources
are equal share one job array; a sweep that changes the resources (say ``cluster.nodes``) gets one
array per distinct allocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import yaml

from restage.config.load import apply_override, config_from_dict
from restage.config.paths import resolve_file_paths, resolve_paths
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError, RestageError
from restage.launch import slurm
from restage.launch.data_check import check_trial_data
from restage.launch.job import TrialJob
from restage.launch.launcher import program_module
from restage.launch.submit import PreparedJob, check_fresh, prepare, validate_job
from restage.launch.trial import TrialPaths, write_json_atomic
from restage.schedule.file import write_schedule

_SWEEP_KEYS = ("base", "name", "overrides", "grid", "zip")
_FIXED = ("experiment", "trial", "run.results_dir")  # they place the sweep directory


@dataclass(frozen=True)
class Trial:
    index: int
    values: dict  # swept key -> value
    config: ExperimentConfig


def check_config_key(key: str) -> None:
    """Refuse a dotted key that does not name a field of ExperimentConfig (free-form mappings accept any key)."""
    tp: object = ExperimentConfig
    walked: list[str] = []
    for part in key.split("."):
        if tp is typing.Any:
            return
        origin = typing.get_origin(tp)
        if origin in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
            origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                where = ".".join(walked) or "the top level"
                raise ConfigError(f"sweep key {key!r} is not a config key: {where} has no {part!r} "
                                  f"(known: {', '.join(hints)})")
            tp = hints[part]
        elif origin is dict:
            tp = typing.get_args(tp)[1]
        else:
            raise ConfigError(f"sweep key {key!r} is not a config key: {'.'.join(walked)} is a value, not a section")
        walked.append(part)


def _apply_overrides(base: dict, spec) -> None:
    if isinstance(spec, dict):
        for key, value in spec.items():
            check_config_key(key)
            _set(base, key, value)
    elif isinstance(spec, list):
        for override in spec:
            check_config_key(str(override).split("=", 1)[0].strip())
            apply_override(base, str(override))
    else:
        raise ConfigError("sweep overrides: give a list of key=value or a mapping")


def _set(data: dict, key: str, value) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"sweep key {key!r}: {part} is not a mapping in the base config")
    node[parts[-1]] = value


def load_sweep(path: str | Path) -> tuple[str, list[Trial]]:
    """Read a sweep file; return its name and the validated trials, in order."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file {path} does not exist")
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path}: not valid YAML; fix the syntax") from None
    unknown = sorted(set(spec) - set(_SWEEP_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r}; a sweep has {', '.join(_SWEEP_KEYS)}")
    if "base" not in spec:
        raise ConfigError(f"{path}: base (the experiment config to sweep over) is missing")
    base_path = (path.parent / spec["base"]) if not Path(spec["base"]).is_absolute() else Path(spec["base"])
    if not base_path.is_file():
        raise ConfigError(f"{path}: base config {base_path} does not exist")
    base = yaml.safe_load(base_path.read_text()) or {}
    if not isinstance(base, dict):
        raise ConfigError(f"{base_path.resolve()}: the top level must be a mapping")
    resolve_file_paths(base, base_path)  # the base's paths against its directory, the sweep's against this file's
    _apply_overrides(base, spec.get("overrides") or [])
    name = str(spec.get("name") or path.stem)
    grid, zipped = spec.get("grid") or {}, spec.get("zip") or {}
    for key, values in [*grid.items(), *zipped.items()]:
        check_config_key(key)
        if key in _FIXED:
            raise ConfigError(f"sweep key {key!r} cannot be swept: every trial of a sweep shares it")
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep key {key!r}: give a non-empty list of values")
    lengths = {len(v) for v in zipped.values()}
    if len(lengths) > 1:
        raise ConfigError(f"{path}: zip lists must have equal lengths, got {sorted(lengths)}")
    zip_rows = [dict(zip(zipped, row)) for row in zip(*zipped.values())] if zipped else [{}]
    grid_rows = [dict(zip(grid, row)) for row in itertools.product(*grid.values())]
    trials = []
    for index, (g, z) in enumerate(itertools.product(grid_rows, zip_rows)):
        values = {**g, **z}
        data = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
        for key, value in values.items():
            _set(data, key, value)
        data["trial"] = f"{name}/{index:03d}"
        resolve_paths(data, path.resolve().parent)
        try:
            trials.append(Trial(index, values, config_from_dict(data)))
        except ConfigError as err:
            raise ConfigError(f"sweep trial {index} ({values}): {err}") from None
    return name, trials


def _group_key(job: PreparedJob) -> str:
    return repr(sorted((k, repr(v)) for k, v in job.params.items()))


def _checked(trial: Trial, job: PreparedJob, module: str):
    """``restage submit``'s checks on one trial (its schedule, or None for another program); the error names it."""
    try:
        return validate_job(job, module, resume=False)
    except RestageError as err:  # the same kind of error, naming the trial
        raise type(err)(f"sweep trial {trial.index:03d} {trial.values}: {err}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("sweep", help="sweep YAML (base config, grid, zip)")
    parser.add_argument("--dry-run", action="store_true", help="print the trials and sbatch script(s); submit nothing")


def main(args: argparse.Namespace) -> int:
    name, trials = load_sweep(args.sweep)
    jobs = [(trial, prepare(trial.config)) for trial in trials]
    module = program_module(trials[0].config)  # refuse now, not in the queue, when the program cannot be imported
    schedules = [_checked(trial, job, module) for trial, job in jobs]
    sweep_dir = jobs[0][1].paths.root.parent
    groups: dict[str, list] = {}
    for trial, job in jobs:
        groups.setdefault(_group_key(job), []).append((trial, job))
    folder = sweep_dir / "slurm"
    if args.dry_run:
        for trial, job in jobs:
            print(f"# trial {trial.index:03d} {trial.values} -> {job.paths.root} ({job.geometry.world_size} ranks)")
        for members in groups.values():
            print(f"# job array of {len(members)} trial(s): {', '.join(f'{t.index:03d}' for t, _ in members)}")
            print(slurm.sbatch_script({**members[0][1].params, "map_count": len(members)}, folder), end="")
        return 0
    for _, job in jobs:
        check_fresh(job.paths, resume=False)
    for (trial, job), schedule in zip(jobs, schedules):
        if schedule is None:
            continue
        job.paths.root.mkdir(parents=True, exist_ok=True)  # the trial runs the plan checked here, on this data
        write_schedule(schedule, job.paths.schedule)
        for line in check_trial_data(job.paths.root, trial.config, False, False, None):
            print(line, flush=True)
    entries = []
    for members in groups.values():
        executor = slurm.make_executor(folder, members[0][1].params, trials[0].config.slurm.max_requeues)
        with slurm.quiet_submission():
            with executor.batch():
                submitted = [executor.submit(TrialJob(), job.config_dict, str(job.paths.root)) for _, job in members]
        for (trial, job), handle in zip(members, submitted):
            entry = {"index": trial.index, "trial": trial.config.trial, "trial_dir": str(job.paths.root),
                     "values": trial.values, "job_id": handle.job_id, "world_size": job.geometry.world_size,
                     "stdout": str(handle.paths.stdout)}
            job.paths.root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(TrialPaths(job.paths.root).submission, {**entry, "sweep": str(sweep_dir)})
            entries.append(entry)
    entries.sort(key=lambda e: e["index"])
    write_json_atomic(sweep_dir / "index.json", {"sweep": name, "experiment": trials[0].config.experiment,
                                                 "sweep_file": str(Path(args.sweep).resolve()),
                                                 "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "trials": entries})
    arrays = sorted({e["job_id"].split("_")[0] for e in entries})
    print(f"submitted {len(entries)} trial(s) as job array(s) {', '.join(arrays)}; index: {sweep_dir / 'index.json'}")
    return 0
