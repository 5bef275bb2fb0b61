"""The sbatch side: submitit parameters from the config, the cluster preamble from ``templates/<name>.sh``.

A job is one sbatch script: resources from the config and the site (nodes, ranks and GPUs per node, time,
partition, account, QoS, memory, exclusive, constraint, CPUs per task: ``launch.resources``), then the rendered template (module
loads, environment, container flags), then restage's block (rendezvous host and port, rank
geometry), then the job driver: submitit's ``_submit`` runs ``restage.launch.job.TrialJob``
in the batch step itself (``exec``, no srun), so the pre-timeout signal (``B:USR2``) reaches
only the driver, which asks the ranks to checkpoint and requeues the job.

Templates are shell with double-brace placeholders, filled from the job's own values and
``slurm.template_vars``; a placeholder without a value is an error that names it, except on a
comment line (``#`` first), where it is left as written: a comment may show the syntax.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from submitit import SlurmExecutor
from submitit.core.utils import FailedJobError
from submitit.slurm.slurm import _make_sbatch_string

from restage.errors import ConfigError, LaunchError
from restage.launch.geometry import JobGeometry
from restage.launch.resources import Resources

_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
PREEMPT_SIGNAL = "USR2"  # submitit's default; NCCL may use USR1


def template_dirs() -> list[Path]:
    """Where ``templates/<name>.sh`` is looked up: $RESTAGE_TEMPLATE_DIR, ./templates, the repository's."""
    dirs = []
    if os.environ.get("RESTAGE_TEMPLATE_DIR"):
        dirs.append(Path(os.environ["RESTAGE_TEMPLATE_DIR"]))
    dirs += [Path.cwd() / "templates", Path(__file__).resolve().parents[3] / "templates"]
    return dirs


def find_template(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".sh":
        if path.is_file():
            return path
        raise ConfigError(f"slurm.template: {path} does not exist")
    for d in template_dirs():
        if (d / f"{name}.sh").is_file():
            return d / f"{name}.sh"
    known = sorted({p.stem for d in template_dirs() if d.is_dir() for p in d.glob("*.sh")})
    raise ConfigError(f"slurm.template: {name!r} is unknown; use one of {', '.join(known) or '(none found)'} "
                      "or a path to a .sh file")


def render_template(text: str, variables: Mapping[str, object], source: str = "template") -> str:
    """Fill double-brace placeholders; one with no value raises naming it, unless it sits on a comment line."""
    lines = text.splitlines(keepends=True)
    comment = [ln.lstrip().startswith("#") for ln in lines]
    missing = sorted({m.group(1) for ln, c in zip(lines, comment) if not c
                      for m in _PLACEHOLDER.finditer(ln) if m.group(1) not in variables})
    if missing:
        raise ConfigError(f"{source}: variable {missing[0]!r} has no value; set slurm.template_vars.{missing[0]}=..."
                          + (f" (also missing: {', '.join(missing[1:])})" if len(missing) > 1 else ""))

    def fill(match: re.Match) -> str:
        return str(variables[match.group(1)]) if match.group(1) in variables else match.group(0)

    return "".join(_PLACEHOLDER.sub(fill, ln) for ln in lines)


def job_name(cfg) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"restage-{cfg.experiment}")[:64]


def template_variables(cfg, geometry: JobGeometry) -> dict[str, object]:
    """The values a template can use. Only job-level ones: the trials of a sweep share one script."""
    values: dict[str, object] = {
        "experiment": cfg.experiment, "job_name": job_name(cfg), "nodes": geometry.nodes,
        "ranks_per_node": geometry.ranks_per_node, "gpus_per_node": geometry.gpus_per_node,
        "world_size": geometry.world_size, "partition": cfg.slurm.partition, "account": cfg.slurm.account,
        "python": sys.executable, "venv": sys.prefix, "repo": str(Path(__file__).resolve().parents[3]),
    }
    values.update(cfg.slurm.template_vars)
    return values


def preamble(cfg, geometry: JobGeometry) -> str:
    path = find_template(cfg.slurm.template)
    return render_template(path.read_text(), template_variables(cfg, geometry), f"template {path.name}")


def restage_block(geometry: JobGeometry, launcher: str, launch_preview: str, reasons: tuple[str, ...] = ()) -> list[str]:
    """Shell lines that fix the rendezvous and the rank geometry for the driver and every rank; ``reasons``: why
    each resource was asked for (comments)."""
    return [
        *(f"# restage: {line}" for line in reasons),
        "# restage: rendezvous on the first host of the allocation; rank geometry",
        'export RESTAGE_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        "export RESTAGE_RENDEZVOUS_HOST=${RESTAGE_HOSTS%%,*}",
        "export MASTER_ADDR=$RESTAGE_RENDEZVOUS_HOST",
        "export MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))",
        f"export RESTAGE_NODES={geometry.nodes} RESTAGE_RANKS_PER_NODE={geometry.ranks_per_node} "
        f"RESTAGE_GPUS_PER_NODE={geometry.gpus_per_node} RESTAGE_WORLD_SIZE={geometry.world_size}",
        f"export RESTAGE_LAUNCHER={launcher}",
        "# restage: the driver below starts the ranks as",
        f"#   {launch_preview}",
        f"# rank r runs on host r // {geometry.ranks_per_node} as LOCAL_RANK r % {geometry.ranks_per_node}"
        + (f", CUDA_VISIBLE_DEVICES = the node's {geometry.gpus_per_node} GPUs, device index LOCAL_RANK"
           if geometry.gpus_per_node else " (CPU)"),
    ]


SIGNAL_EARLY_SECONDS = 60  # slurmctld checks time limits every 30 s and signals up to 30 s ahead of the asked time


def signal_delay_seconds(slurm) -> int:
    """The ``--signal`` delay: ``slurm.signal_delay_seconds``, capped so that the signal, which may come a minute
    early, comes no sooner than halfway through the time limit; 0 (no time-limit signal) for limits under about
    two and a half minutes. The signal is the fallback: the runtime's deadline rule checkpoints before the limit
    from its measured step and save times (runtime/control/deadline.py); a preemption still signals at once."""
    return max(0, min(slurm.signal_delay_seconds, slurm.time_minutes * 60 // 2 - SIGNAL_EARLY_SECONDS))


def executor_parameters(cfg, geometry: JobGeometry, setup: list[str], resources: Resources) -> dict[str, Any]:
    """``SlurmExecutor.update_parameters`` keywords for this config; ``cfg.slurm.time_minutes`` is the job's
    (``resources.time_minutes``, which ``submit.prepare`` writes into the job's config)."""
    slurm = cfg.slurm
    params: dict[str, Any] = {  # submitit's keywords, each of the type submitit declares for it
        "job_name": job_name(cfg), "time": resources.time_minutes, "nodes": geometry.nodes,
        "ntasks_per_node": geometry.ranks_per_node, "setup": setup, "use_srun": False,
        "signal_delay_s": signal_delay_seconds(slurm), "stderr_to_stdout": True,
    }
    if geometry.gpus_per_node:
        params["gpus_per_node"] = geometry.gpus_per_node
    if resources.cpus_per_task:
        params["cpus_per_task"] = resources.cpus_per_task
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(slurm, key):
            params[key] = getattr(slurm, key)
    if resources.mem:
        params["mem"] = resources.mem
    if slurm.exclusive:
        params["exclusive"] = True
    # B: sends the signal to the batch step only (the driver); requeue must be allowed for submitit's requeue.
    params["additional_parameters"] = {"signal": f"B:{PREEMPT_SIGNAL}@{signal_delay_seconds(slurm)}",
                                       ("requeue" if slurm.requeue else "no-requeue"): True}
    return params


def driver_python() -> str:
    # exec: the batch shell becomes the driver, so B:USR2 reaches submitit's handler, not bash.
    return "exec " + shlex.quote(sys.executable)


def sbatch_script(params: Mapping[str, Any], folder: Path) -> str:
    """The exact script submitit writes for these parameters (``--dry-run``)."""
    command = " ".join([driver_python(), "-u -m submitit.core._submit", shlex.quote(str(folder))])
    return _make_sbatch_string(command=command, folder=folder, **params)


def make_executor(folder: Path, params: Mapping[str, Any], max_requeues: int):
    try:
        executor = SlurmExecutor(folder=folder, max_num_timeout=max_requeues, python=driver_python())
    except RuntimeError as err:
        raise LaunchError(f"cannot submit: {err}") from None
    executor.update_parameters(**params)
    return executor


def sbatch_error(err: BaseException) -> str:
    """sbatch's own message, one line (submitit raises it with the whole stderr)."""
    text = str(err).strip()
    lines = [ln.split("error:", 1)[1].strip() if "error:" in ln else ln.strip() for ln in text.splitlines() if ln.strip()]
    return "; ".join(dict.fromkeys(lines)) or type(err).__name__


@contextlib.contextmanager
def quiet_submission():
    """submitit prints sbatch's stderr before raising; the CLI prints it once, on one line."""
    sink = io.StringIO()
    with contextlib.redirect_stderr(sink):
        try:
            yield
        except Exception as err:
            if isinstance(err, FailedJobError):
                raise LaunchError(f"sbatch refused the job: {sbatch_error(err)}") from None
            raise
