"""``restage submit CONFIG [--dry-run] [--resume] [key=value ...]``: one trial as one SLURM job.

submitit writes the sbatch script (see ``restage.launch.slurm``) into ``<trial>/slurm/`` and
submits it; the job runs ``restage.launch.job.TrialJob``. Before anything is queued the config gets
``restage run``'s checks (``launch.checks``: models, data set, plan), and the plan is written as the
trial's ``schedule.json``, which the job runs. ``--dry-run`` checks the same, prints the script it
would submit and submits nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from restage.config.load import config_from_dict
from restage.errors import LaunchError
from restage.launch import slurm
from restage.launch.checks import load_job_config, validate
from restage.launch.data_check import ACCEPT_OPTION, check_trial_data
from restage.launch.geometry import JobGeometry, job_geometry
from restage.launch.job import TrialJob
from restage.launch.launcher import (
    RUNTIME_MODULE,
    cpus_per_rank,
    forwarded_names,
    interface_environment,
    launch_command,
    network_interface,
    program_module,
    rank_environment,
    rank_program,
)
from restage.launch.resources import site_resources
from restage.launch.trial import TrialPaths, write_json_atomic
from restage.runtime.checkpoint.checkpoint_dir import complete_steps
from restage.schedule.file import write_schedule


@dataclass(frozen=True)
class PreparedJob:
    """Everything needed to submit one trial (or to print its script)."""

    config_dict: dict  # resolved, with an absolute run.results_dir
    paths: TrialPaths
    geometry: JobGeometry
    params: dict


def resolved_dict(cfg) -> dict:
    """The config as the job will see it: results_dir, and the model, data set and tokenizer paths that
    exist here, made absolute (the job may start in another directory)."""
    data = cfg.to_dict()
    data["run"]["results_dir"] = str(Path(cfg.run.results_dir).resolve())
    for spec in data["models"].values():
        spec["path"] = _absolute_if_here(spec["path"])
    for key in ("path", "tokenizer"):
        data["dataset"][key] = _absolute_if_here(data["dataset"][key])
    return data


def _absolute_if_here(path: str) -> str:
    # A path that does not exist here may be a hub name or a path on the cluster's own file system: kept.
    return str(Path(path).resolve()) if path and not Path(path).is_absolute() and Path(path).exists() else path


def launch_preview(cfg, geometry: JobGeometry) -> str:
    """The rank launch line the driver will run, with the allocation's hosts and the trial as placeholders
    (the trials of a sweep share one script)."""
    hosts = [f"<host{i}>" for i in range(geometry.nodes)] if cfg.slurm.launcher == "mpirun" else None
    module = os.environ.get("RESTAGE_PROGRAM") or cfg.slurm.program or RUNTIME_MODULE
    paths = TrialPaths(Path("<trial_dir>"))
    # The driver divides the allocation's SLURM_CPUS_ON_NODE among the ranks when slurm.cpus_per_task is 0.
    cpus = cpus_per_rank(cfg, geometry, {}) or "<cpus_on_node/ranks_per_node>"
    interface = network_interface(cfg)
    names = {**rank_environment(paths, geometry, module, False, "<host0>", 0), **interface_environment(interface)}
    command = launch_command(cfg.slurm.launcher, geometry, hosts, rank_program(module, paths.schedule),
                             forwarded_names({**os.environ, **names}), (), cpus, interface)
    return " ".join(command)  # a comment in the script: placeholders stay readable


def prepare(cfg) -> PreparedJob:
    """Check the config, ask the site (``launch.resources``), render the preamble, compute submitit's parameters
    (no job is queued). The job's config carries the time and launcher chosen here."""
    geometry = job_geometry(cfg)
    resources = site_resources(cfg.slurm, geometry)
    cfg = dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, time_minutes=resources.time_minutes,
                                                             launcher=resources.launcher))
    data = resolved_dict(cfg)
    paths = TrialPaths(Path(data["run"]["results_dir"]) / cfg.experiment / cfg.trial)
    setup = slurm.preamble(cfg, geometry).rstrip("\n").splitlines() + [""]
    setup += slurm.restage_block(geometry, resources.launcher, launch_preview(cfg, geometry), resources.reasons)
    return PreparedJob(data, paths, geometry, slurm.executor_parameters(cfg, geometry, setup, resources))


def validate_job(job: PreparedJob, module: str, resume: bool):
    """``restage run``'s checks (``checks.validate``: models, data set, plan) on the job's config, when the ranks
    run restage's runtime; the schedule, or None when not planned (another program, or a resumed trial that
    keeps its schedule)."""
    if module != RUNTIME_MODULE:
        return None
    return validate(config_from_dict(job.config_dict), plan=not (resume and job.paths.schedule.is_file()))


def check_fresh(paths: TrialPaths, resume: bool) -> None:
    if resume:
        return
    if paths.checkpoints.is_dir() and any(paths.checkpoints.iterdir()):
        raise LaunchError(f"{paths.root} already has checkpoints; pass --resume to continue that trial "
                          f"or choose another run.trial")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. cluster.nodes=2")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch script and submit nothing")
    parser.add_argument("--resume", action="store_true", help="continue a trial that already has checkpoints")
    parser.add_argument(ACCEPT_OPTION, action="store_true", dest="accept_changed_data",
                        help="--resume on data that changed since the checkpoint (recorded in the trial's data.json)")
    allow_options_between_overrides(parser)


def allow_options_between_overrides(parser: argparse.ArgumentParser) -> None:
    """``restage submit job.yaml --dry-run a=1`` must work: plain parse_args stops taking overrides after
    an option, parse_intermixed_args does not (cli.py calls parser.parse_args)."""
    parser.parse_args = parser.parse_intermixed_args  # type: ignore[method-assign]


def main(args: argparse.Namespace) -> int:
    cfg, _, notes = load_job_config(args.config, args.overrides)
    for note in notes:
        print(note, file=sys.stderr, flush=True)
    job = prepare(cfg)
    module = program_module(cfg)  # refuse now, not in the queue, when the program cannot be imported
    schedule = validate_job(job, module, args.resume)
    folder = job.paths.slurm_folder
    if args.dry_run:
        print(slurm.sbatch_script(job.params, folder), end="")
        if schedule is not None:
            print(f"restage: checked: models, data set and a plan for {job.geometry.world_size} ranks "
                  f"({job.geometry.nodes} x {job.geometry.ranks_per_node}) that fits", file=sys.stderr)
        return 0
    check_fresh(job.paths, args.resume)
    job.paths.root.mkdir(parents=True, exist_ok=True)
    if module == RUNTIME_MODULE:  # the data's fingerprint, kept with the trial; --resume refuses changed data
        steps = complete_steps(job.paths.root) if args.resume else []
        for line in check_trial_data(job.paths.root, config_from_dict(job.config_dict), args.resume,
                                     args.accept_changed_data, steps[-1] if steps else None):
            print(line, flush=True)
    if schedule is not None:  # the job runs what was checked here (it plans only when there is no schedule)
        write_schedule(schedule, job.paths.schedule)

    executor = slurm.make_executor(folder, job.params, cfg.slurm.max_requeues)
    with slurm.quiet_submission():
        submitted = executor.submit(TrialJob(), job.config_dict, str(job.paths.root), args.resume)
    write_json_atomic(job.paths.submission, {
        "job_id": submitted.job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), "slurm_folder": str(folder),
        "script": str(submitted.paths.submission_file), "stdout": str(submitted.paths.stdout),
        "world_size": job.geometry.world_size, "program": program_module(cfg)})
    geometry = job.geometry
    print(f"submitted job {submitted.job_id}: {geometry.nodes} node(s) x {geometry.ranks_per_node} ranks -> {job.paths.root}")
    return 0
