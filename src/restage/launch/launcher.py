"""How the job driver starts every rank of a trial: the program they run, the launcher's command line (mpirun or
srun) over the allocation's hosts, the rendezvous, the environment forwarded and set, and the cores each rank is
bound to. Pure functions of the config, the geometry and the environment (``launch/job.py`` calls them)."""

from __future__ import annotations

import importlib.util
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from restage.errors import LaunchError
from restage.launch.geometry import JobGeometry
from restage.launch.mpirun import mpirun_command
from restage.launch.trial import TrialPaths
from restage.runtime.control.spawn import free_port

RUNTIME_MODULE = "restage.runtime.spmd"
SELFTEST_MODULE = "restage.launch.selftest"
LAUNCHERS = ("mpirun", "srun")


def program_module(cfg) -> str:
    """The module every rank runs: $RESTAGE_PROGRAM, else slurm.program, else the restage runtime."""
    module = os.environ.get("RESTAGE_PROGRAM") or cfg.slurm.program or RUNTIME_MODULE
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        hint = (f"; to test the launch path alone set slurm.program={SELFTEST_MODULE}" if module == RUNTIME_MODULE else "")
        raise LaunchError(f"program {module} is not importable from {sys.executable}{hint}")
    return module


def node_launcher(setting: str) -> str:
    """srun or mpirun: ``restage submit`` resolved ``auto`` where it ran; a config that still says ``auto`` (a job
    submitted by other means) is resolved here, on the node, the same way."""
    if setting != "auto":
        return setting
    from restage.launch.resources import choose_launcher
    from restage.launch.site import srun_mpi_plugins

    return choose_launcher(setting, srun_mpi_plugins())[0]


def allocation_hosts(env: Mapping[str, str] = os.environ) -> list[str]:
    """Hosts of the allocation in SLURM's order (the sbatch script exports RESTAGE_HOSTS)."""
    if env.get("RESTAGE_HOSTS"):
        return env["RESTAGE_HOSTS"].split(",")
    if env.get("SLURM_JOB_NODELIST"):
        out = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                             capture_output=True, text=True, check=True).stdout
        return out.split()
    return [socket.gethostname()]


def rendezvous(hosts: Sequence[str], job_id: str | None, env: Mapping[str, str] = os.environ) -> tuple[str, int]:
    """(host, port) of the torch.distributed rendezvous: rank 0 lives on the first host."""
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    if job_id and job_id.isdigit():
        return hosts[0], 20000 + int(job_id) % 20000

    return hosts[0], free_port()


def launch_command(launcher: str, geometry: JobGeometry, hosts: Sequence[str] | None, program: Sequence[str],
                   env_names: Sequence[str] = (), extra_args: Sequence[str] = (), cpus_per_rank: int | str | None = None,
                   interface: str = "") -> list[str]:
    """The command that starts every rank of the job (``hosts`` None: all on this machine).

    ``cpus_per_rank``: the cores each rank is bound to (see ``cpus_per_rank``); None binds nothing; a str is a
    placeholder, written into the command as it is (``launch_preview``'s).
    """
    if launcher == "mpirun":
        return mpirun_command(geometry.world_size, program, hosts=hosts, ranks_per_node=geometry.ranks_per_node,
                              env=env_names, extra_args=extra_args, cpus_per_rank=cpus_per_rank, interface=interface)
    if launcher == "srun":
        # Each task is one rank with its share of the node's cores: srun does not inherit sbatch's
        # --cpus-per-task (Slurm >= 22.05), so without it every rank gets one core. PMIx lets mpi4py's
        # MPI_Init find its peers.
        binding = [f"--cpus-per-task={cpus_per_rank}", "--cpu-bind=cores"] if cpus_per_rank else []
        return ["srun", "--mpi=pmix", f"--nodes={geometry.nodes}", f"--ntasks={geometry.world_size}",
                f"--ntasks-per-node={geometry.ranks_per_node}", *binding, "--kill-on-bad-exit=1", "--export=ALL",
                *extra_args, *program]
    raise LaunchError(f"slurm.launcher: {launcher!r} must be one of {', '.join(LAUNCHERS)}")


# What the ranks need from the driver's environment on every node (mpirun forwards only what -x names;
# srun --export=ALL forwards everything). CUDA_VISIBLE_DEVICES is each node's own (SLURM sets it there).
FORWARD_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "DS_", "GLOO_", "UCX_", "FI_", "HF_", "TRANSFORMERS_",
                    "OMP_", "MKL_", "RESTAGE_")
FORWARD_NAMES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "PATH", "VIRTUAL_ENV", "PYTHONUNBUFFERED",
                 "MASTER_ADDR", "MASTER_PORT")
NOT_FORWARDED = ("CUDA_VISIBLE_DEVICES",)


def forwarded_names(env: Mapping[str, str] = os.environ, extra: Sequence[str] = ()) -> list[str]:
    """The variables mpirun must forward (-x): every one with a prefix above present here, plus ``extra``."""
    names = {n for n in env if (n.startswith(FORWARD_PREFIXES) or n in FORWARD_NAMES) and n not in NOT_FORWARDED}
    return sorted(names | set(extra))


def cpus_per_rank(cfg, geometry: JobGeometry, env: Mapping[str, str] = os.environ,
                  usable_cpus: int | None = None) -> int | None:
    """The cores each rank is bound to: slurm.cpus_per_task, else the node's CPUs in this allocation
    (SLURM_CPUS_ON_NODE) divided among its ranks; None outside SLURM (nothing is bound).

    ``usable_cpus`` (the driver's own CPU set; nodes are alike) caps it: a node that advertises more CPUs
    than it has (a test cluster) or more ranks than cores gets fewer cores per rank, or no binding at all.
    """
    if cfg.slurm.cpus_per_task:
        cpus = cfg.slurm.cpus_per_task
    elif env.get("SLURM_CPUS_ON_NODE", "").isdigit():
        cpus = max(1, int(env["SLURM_CPUS_ON_NODE"]) // geometry.ranks_per_node)
    else:
        return None
    if usable_cpus is not None:
        cpus = min(cpus, usable_cpus // geometry.ranks_per_node)
    return cpus or None


def network_interface(cfg, env: Mapping[str, str] = os.environ) -> str:
    """The interface ranks talk over between nodes: $RESTAGE_NETWORK_INTERFACE, else slurm.network_interface."""
    return env.get("RESTAGE_NETWORK_INTERFACE") or cfg.slurm.network_interface


def interface_environment(interface: str, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """NCCL's, gloo's and Open MPI's (for ranks srun starts, which read no mpirun flags) interface follow the
    pinned one unless the user set them: an interface the nodes cannot reach each other on costs a TCP
    connect timeout (minutes) at the first message."""
    if not interface:
        return {}
    names = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include")
    return {name: interface for name in names if not env.get(name)}


def rank_program(module: str, schedule: Path | str) -> list[str]:
    prefix = shlex.split(os.environ.get("RESTAGE_RANK_PREFIX", ""))  # e.g. a container runtime
    return [*prefix, sys.executable, "-u", "-m", "restage.launch.rank", module, str(schedule)]


def rank_environment(paths: TrialPaths, geometry: JobGeometry, module: str, resume: bool,
                     host: str, port: int, cpus: int | None = None) -> dict[str, str]:
    """The variables every rank gets on top of the driver's environment. Ranks bound to ``cpus`` cores each get
    ``OMP_NUM_THREADS=cpus`` (the driver's environment's, e.g. a template's, is replaced); unbound ranks keep the
    driver's, or when it has none each takes its share of its CPU mask (``restage.runtime.control.threads``)."""
    threads = {"OMP_NUM_THREADS": str(cpus)} if cpus else {}
    return {
        "RESTAGE_TRIAL_DIR": str(paths.root), "RESTAGE_CONFIG": str(paths.config), "RESTAGE_SCHEDULE": str(paths.schedule),
        "RESTAGE_PROGRAM": module, "RESTAGE_RESUME": "1" if resume else "0", "RESTAGE_PREEMPT_FILE": str(paths.preempt_file),
        "RESTAGE_NODES": str(geometry.nodes), "RESTAGE_RANKS_PER_NODE": str(geometry.ranks_per_node),
        "RESTAGE_GPUS_PER_NODE": str(geometry.gpus_per_node), "RESTAGE_WORLD_SIZE": str(geometry.world_size),
        "RESTAGE_RENDEZVOUS_HOST": host, "MASTER_ADDR": host, "MASTER_PORT": str(port),
        "PYTHONUNBUFFERED": "1", **threads,
    }
