"""What the SLURM site has, asked where ``restage submit`` runs: its partitions' CPUs and time limits (``sinfo``)
and the MPI plugins of its ``srun`` (``srun --mpi=list``).

Each answer is None where the command is missing or fails (a laptop, a login node without a controller): the
caller then says so and uses its fallback. ``RESTAGE_SITE_PROBE=0`` asks nothing (tests of the script text).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

PROBE_TIMEOUT_SECONDS = 15.0


def _ask(command: list[str]) -> str | None:
    if os.environ.get("RESTAGE_SITE_PROBE", "1") == "0" or shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def srun_mpi_plugins() -> list[str] | None:
    """The MPI plugin types this site's srun offers (``pmix``, ``pmix_v4``, ``pmi2``, ...), None without srun."""
    out = _ask(["srun", "--mpi=list"])
    if out is None:
        return None
    names = re.findall(r"\b(pmix(?:_v\d+)?|pmi2|cray_shasta|none)\b", out)
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class Partition:
    """One partition as sinfo reports it: its name, the fewest CPUs of its nodes, its time limit in minutes
    (None: unlimited)."""

    name: str
    cpus_per_node: int
    time_limit_minutes: int | None


def parse_time_limit(text: str) -> int | None:
    """sinfo's ``%l``: ``infinite``/``UNLIMITED`` -> None; ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``,
    ``D-H:M:S`` -> whole minutes."""
    text = text.strip()
    if text.lower() in ("infinite", "unlimited", "n/a", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, minutes, seconds = (parts + [0, 0])[:3]
        return int(days) * 1440 + hours * 60 + minutes + (seconds > 0)
    if len(parts) == 3:
        return parts[0] * 60 + parts[1] + (parts[2] > 0)
    if len(parts) == 2:
        return parts[0] + (parts[1] > 0)
    return parts[0]


def partition(name: str = "") -> Partition | None:
    """``name`` (or the default partition when empty) as sinfo reports it; None when sinfo cannot answer or the
    partition is unknown (sbatch then says so itself)."""
    out = _ask(["sinfo", "-h", "-o", "%P|%c|%l"])
    if out is None:
        return None
    rows = [line.split("|") for line in out.splitlines() if line.count("|") == 2]
    # A partition has a row per kind of node; the default partition's name ends in '*'.
    mine = [r for r in rows if (r[0].rstrip("*") == name if name else r[0].endswith("*"))]
    if not mine:
        return None
    try:
        cpus = min(int(r[1].rstrip("+")) for r in mine)
        limit = parse_time_limit(mine[0][2])
    except ValueError:
        return None
    return Partition(mine[0][0].rstrip("*"), cpus, limit)
