"""The control plane: MPI for small messages, and the torch.distributed bootstrap from MPI.

Tensors never go through here; only batch metadata, statistics and decisions (a few KB a
step). The torch.distributed rendezvous address comes from rank 0 over MPI, so no
environment variables have to be agreed on outside the job.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from restage.runtime.spawn import free_port, warm_world


class Control:
    """A thin, explicit wrapper over ``MPI.COMM_WORLD`` (pickled Python objects)."""

    def __init__(self, comm=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def bcast(self, obj: Any = None) -> Any:
        """Master's object to everyone."""
        return self.comm.bcast(obj, root=0)

    def gather(self, obj: Any) -> list[Any] | None:
        """Everyone's object to the master (None elsewhere)."""
        return self.comm.gather(obj, root=0)

    def allgather(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        self.comm.Barrier()


def local_rank() -> int:
    """This process's index on its node, from the launcher's environment."""
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "LOCAL_RANK", "MPI_LOCALRANKID"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def init_torch_distributed(control: Control, timeout_seconds: float, backend: str | None = None,
                           startup_timeout_seconds: float | None = None) -> str:
    """Join torch.distributed over all MPI ranks; NCCL with CUDA, gloo otherwise. Returns the backend.

    The rendezvous and the world's first collective (``warm_world``) wait up to
    ``startup_timeout_seconds`` (peers may still be importing); afterwards the world's ops time out
    after ``timeout_seconds`` (the data-plane timeout, NCCL's watchdog).
    """
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    address = None
    if control.is_master:
        address = (os.environ.get("RESTAGE_RENDEZVOUS_HOST") or socket.gethostname(), free_port())
    host, port = control.bcast(address)
    startup = timeout_seconds if startup_timeout_seconds is None else startup_timeout_seconds
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=control.rank,
                            world_size=control.world_size, timeout=datetime.timedelta(seconds=startup))
    warm_world()
    set_world_timeout(timeout_seconds)
    return backend


def set_world_timeout(timeout_seconds: float) -> None:
    """The world group's timeout for every later op (NCCL's watchdog); start-up ran under its own."""
    import torch.distributed as dist

    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_seconds))  # no public setter


_ready_rounds: dict[tuple[int, ...], int] = {}


def wait_for_ranks(ranks, timeout_seconds: float) -> None:
    """Return once every rank of ``ranks`` has called this (in the same order on each): a barrier over the store.

    Run before a transfer whose ranks may still be in a long step, so NCCL's watchdog (counted
    from when an op is queued) only times the transfer; the wait itself is bounded by
    ``timeout_seconds`` and no communicator is involved.
    """
    import torch.distributed as dist

    key = tuple(sorted(set(ranks)))
    if dist.get_rank() not in key or len(key) < 2:
        return
    round_ = _ready_rounds.get(key, 0)
    _ready_rounds[key] = round_ + 1
    name = f"restage_ready/{','.join(map(str, key))}/{round_}"
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank shares
    if store.add(name, 1) == len(key):
        store.set(name + "/all", "1")
    store.wait([name + "/all"], datetime.timedelta(seconds=timeout_seconds))
