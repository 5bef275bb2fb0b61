"""Check, before any rank starts, that every node of the allocation sees the trial directory.

Ranks write checkpoints, logs and failure reports into the trial directory, and the master reads
what the others wrote, so it must be one shared directory (NFS, Lustre, ...) on every node. The
driver writes a token file there and runs one task per node (``srun --ntasks-per-node=1``) that
reads it back; a node that reads something else (or nothing) does not share the directory.
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Sequence
from pathlib import Path

from restage.errors import LaunchError

CHECK_TIMEOUT_SECONDS = 60.0


def probe_command(token_file: Path, nodes: int) -> list[str]:
    """One task per node prints its node name and what it reads in ``token_file``."""
    script = f'printf "%s %s\\n" "$SLURMD_NODENAME" "$(cat {token_file} 2>/dev/null || echo missing)"'
    return ["srun", "--mpi=none", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--overlap",
            "--kill-on-bad-exit=0", "--cpu-bind=none", "sh", "-c", script]


def unshared_nodes(output: str, hosts: Sequence[str], token: str) -> list[str]:
    """The hosts whose line does not show ``token`` (a node that printed nothing counts as not sharing)."""
    seen = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2:
            seen[parts[0]] = parts[1]
    return [h for h in hosts if seen.get(h) != token]


def check_shared_directory(directory: Path, hosts: Sequence[str]) -> None:
    """Raise a one-line LaunchError naming the nodes that do not see ``directory`` as the driver does."""
    token = secrets.token_hex(8)
    token_file = Path(directory) / f".shared-check-{os.getpid()}"
    token_file.write_text(token + "\n")
    try:
        done = subprocess.run(probe_command(token_file, len(hosts)), capture_output=True, text=True,
                              timeout=CHECK_TIMEOUT_SECONDS)
        output = done.stdout
    except subprocess.TimeoutExpired as err:
        output = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
    finally:
        token_file.unlink(missing_ok=True)
    missing = unshared_nodes(output, hosts, token)
    if missing:
        raise LaunchError(f"the trial directory {directory} is not shared by every node: {', '.join(missing)} "
                          f"do(es) not see the file the driver wrote there; set run.results_dir to a directory "
                          "all nodes mount (NFS, Lustre, ...)")
