"""How many CPU threads a rank's torch uses: the cores it may run on, shared with the ranks beside it.

Without a rule every rank takes torch's default (a thread per core of the node: N ranks on one node
oversubscribe it N times) or whatever OMP_NUM_THREADS a launcher left (1: each rank on one core).
The rule, first match wins:

1. ``run.threads_per_rank`` > 0 in the config;
2. ``OMP_NUM_THREADS`` in the rank's environment (a user's, a template's, or the SLURM driver's: it sets
   it to the cores it bound each rank to);
3. ``SLURM_CPUS_PER_TASK`` (set by ``-c``/``--cpus-per-task``: the cores SLURM gave each task), at most
   the cores in the rank's CPU mask;
4. the rank's CPU mask (``os.sched_getaffinity``: what ``srun --cpu-bind`` or ``mpirun --bind-to`` left it),
   divided among the ranks of this node that share it. A rank sees only its own mask, so it counts them
   from the mask's share of the CPUs this node gives the job (its cgroup's cpuset): ranks bound apart
   hold small masks and share with none; ranks left unbound hold the whole set and share it with every
   local rank. When that set cannot be read, every local rank is taken to share the mask.
   Where every local rank shares the mask, those the schedule gives no op (a plan may leave a rank
   idle: GRPO tiny on 2 ranks runs every MFC on rank 0) take one thread and leave their share of the
   cores to the ranks that work: they only wait for control messages, sleeping between polls.

The count is at least 1. It is applied with ``torch.set_num_threads`` (and as many inter-op threads), and
exported as ``OMP_NUM_THREADS`` for what the rank starts.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

THREADS_KEY = "run.threads_per_rank"


@dataclass(frozen=True)
class ThreadChoice:
    count: int  # torch intra-op threads of this rank
    reason: str  # where it came from, for the start-up line


def _positive(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def threads_for(affinity: Collection[int], local_size: int, local_rank: int, env: Mapping[str, str],
                configured: int = 0, node_cpus: int | None = None,
                idle_local_ranks: Collection[int] = ()) -> ThreadChoice:
    """This rank's thread count (the rule in the module docstring).

    ``affinity``: the rank's CPU mask; ``local_size``/``local_rank``: the ranks on this node and this one's
    index; ``configured``: ``run.threads_per_rank`` (0: automatic); ``node_cpus``: how many CPUs this node
    gives the job (None: unknown, so the mask is taken as shared by every local rank);
    ``idle_local_ranks``: the local indices of this node's ranks that the schedule gives no op.
    """
    if configured > 0:
        return ThreadChoice(configured, f"{THREADS_KEY}={configured}")
    omp = _positive(env, "OMP_NUM_THREADS")
    if omp is not None:
        return ThreadChoice(omp, f"OMP_NUM_THREADS={omp}")
    cores = max(1, len(affinity))
    per_task = _positive(env, "SLURM_CPUS_PER_TASK")
    if per_task is not None:
        return ThreadChoice(min(per_task, cores), f"SLURM_CPUS_PER_TASK={per_task}, {cores} cores in its CPU mask")
    local_size = max(1, local_size)
    if node_cpus is None or node_cpus < cores:
        sharing = local_size
    else:  # ranks spread evenly over the node's CPUs: a mask holding 1/k of them is shared by local_size/k
        sharing = min(local_size, max(1, math.ceil(local_size * cores / node_cpus)))
    idle = set(idle_local_ranks)
    working = [r for r in range(local_size) if r not in idle]
    if sharing == local_size and working and len(working) < local_size:  # every local rank shares the mask
        if local_rank not in working:
            return ThreadChoice(1, f"no op of the schedule on it: the {cores} cores of its CPU mask go to the "
                                   f"{len(working)} of the node's {local_size} rank(s) that have some")
        # The first (cores % sharing) of the working ranks take one core more.
        sharing, index = len(working), working.index(local_rank)
        count = max(1, cores // sharing + (1 if index < cores % sharing else 0))
        return ThreadChoice(count, f"{cores} cores in its CPU mask, shared by the {sharing} of the node's "
                                   f"{local_size} rank(s) that have ops")
    # The first (cores % sharing) of the ranks sharing the mask take one core more.
    count = max(1, cores // sharing + (1 if local_rank % sharing < cores % sharing else 0))
    return ThreadChoice(count, f"{cores} cores in its CPU mask, shared by {sharing} of the node's {local_size} rank(s)")


def idle_local_ranks(ranks_with_ops: Collection[int], rank: int, ranks_per_node: int, world_size: int) -> frozenset[int]:
    """Local indices of the ranks on ``rank``'s node that hold no op (block placement: rank r runs on node
    r // ranks_per_node, as ``launch.geometry`` places them)."""
    first = rank // ranks_per_node * ranks_per_node
    busy = set(ranks_with_ops)
    return frozenset(r - first for r in range(first, min(first + ranks_per_node, world_size)) if r not in busy)


def _tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """SLURM_TASKS_PER_NODE ("2(x3),1": two tasks on each of three nodes, then one) for node ``node``."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def local_ranks(env: Mapping[str, str]) -> tuple[int, int]:
    """(ranks on this node, this rank's index among them) from Open MPI's, SLURM's or the plain variables."""
    if _positive(env, "OMPI_COMM_WORLD_LOCAL_SIZE"):
        return int(env["OMPI_COMM_WORLD_LOCAL_SIZE"]), int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0") or 0)
    if _positive(env, "LOCAL_WORLD_SIZE"):  # restage.launch.rank's, torchrun's
        return int(env["LOCAL_WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0") or 0)
    if env.get("SLURM_LOCALID", "").isdigit():
        size = _positive(env, "SLURM_NTASKS_PER_NODE") or _tasks_on_node(
            env.get("SLURM_TASKS_PER_NODE", ""), int(env.get("SLURM_NODEID", "0") or 0))
        if size:
            return size, int(env["SLURM_LOCALID"])
    return 1, 0


def _cpu_list_size(text: str) -> int | None:
    """How many CPUs a cpuset list ("0-3,8,10-11") names."""
    total = 0
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        total += int(high or low) - int(low) + 1
    return total or None


def cgroup_cpus(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The CPUs this process's cgroup allows (cgroup v2, else v1's cpuset), or None when that cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            candidate = root / path.lstrip("/") / "cpuset.cpus.effective"
        elif "cpuset" in controllers.split(","):
            candidate = root / "cpuset" / path.lstrip("/") / "cpuset.effective_cpus"
        else:
            continue
        try:
            return _cpu_list_size(candidate.read_text())
        except OSError:
            continue
    return None


def choose_threads(configured: int = 0, env: Mapping[str, str] = os.environ,
                   idle_local: Collection[int] = ()) -> ThreadChoice:
    """This process's thread count from its own mask, environment and cgroup; ``idle_local``: the local indices
    of this node's ranks that hold no op (``idle_local_ranks``)."""
    local_size, local_rank = local_ranks(env)
    return threads_for(os.sched_getaffinity(0), local_size, local_rank, env, configured, cgroup_cpus(), idle_local)


def apply_threads(choice: ThreadChoice) -> None:
    """Set torch's intra- and inter-op threads to ``choice.count``; export OMP_NUM_THREADS for child processes."""
    import torch  # heavy: the rule above is read without it (restage.launch.rank imports nothing heavy)

    torch.set_num_threads(choice.count)
    try:
        torch.set_num_interop_threads(choice.count)
    except RuntimeError:  # only possible before any inter-op work; a caller that ran some keeps torch's pool
        pass
    os.environ["OMP_NUM_THREADS"] = str(choice.count)
