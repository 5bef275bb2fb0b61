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

from restage.runtime.spawn import free_port


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


def init_torch_distributed(control: Control, timeout_seconds: float, backend: str | None = None) -> str:
    """Join torch.distributed over all MPI ranks; NCCL with CUDA, gloo otherwise. Returns the backend."""
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
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=control.rank,
                            world_size=control.world_size, timeout=datetime.timedelta(seconds=timeout_seconds))
    return backend
