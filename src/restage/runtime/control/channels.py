"""The control plane: MPI for small messages, and the torch.distributed bootstrap from MPI.

Tensors never go through here; only batch metadata, statistics and decisions (a few KB a
step). The torch.distributed rendezvous address comes from rank 0 over MPI, so no
environment variables have to be agreed on outside the job.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from restage.runtime.control.spawn import free_port, warm_world

if TYPE_CHECKING:  # importing mpi4py initializes MPI: only the functions that talk over it import it
    from mpi4py import MPI


class Control:
    """A thin, explicit wrapper over ``MPI.COMM_WORLD`` (pickled Python objects)."""

    def __init__(self, comm: MPI.Comm | None = None) -> None:
        if comm is None:
            # lazy: importing mpi4py initialises MPI; `restage generate`'s launcher imports this module and is no MPI rank
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
        return bcast(self.comm, obj, root=0)

    def gather(self, obj: Any) -> list[Any] | None:
        """Everyone's object to the master (None elsewhere)."""
        return gather(self.comm, obj, root=0)

    def allgather(self, obj: Any) -> list[Any]:
        return allgather(self.comm, obj)

    def barrier(self) -> None:
        arrive(self.comm)


# Every wait of the control plane is a non-blocking MPI operation tested with sleeps in between, never one of
# Open MPI's blocking calls: those busy-poll, and a rank waiting minutes for peers in a long generate or train
# step then holds a core at 100%. Every thread bound to that core starves (NCCL's proxy thread, gloo's I/O
# threads, DeepSpeed's CPU ops, the kernel's deferred network processing). On the multinode test cluster
# (nodes sharing this machine's two cores) a spinning rank held 94-100% of its core while a peer bound to the
# same core got about 3%, and packets between the nodes waited so long that TCP retransmitted with
# exponential backoff: transfers took 13, 25, 51, 102 and 204 s.
#
# Polling intervals: short at first (a peer that is nearly there costs little), then at most this long, so a
# wait adds at most ~2 ms to a control message.
_FIRST_POLL_SECONDS, _LONGEST_POLL_SECONDS = 5e-5, 2e-3


def wait_quietly(requests: Iterable[MPI.Request]) -> None:
    """Complete MPI ``requests``, sleeping between tests instead of spinning."""
    # lazy: importing mpi4py initialises MPI; `restage generate`'s launcher imports this module and is no MPI rank
    from mpi4py import MPI

    requests = list(requests)
    pause = _FIRST_POLL_SECONDS
    while not MPI.Request.Testall(requests):
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_POLL_SECONDS)


def arrive(comm: MPI.Comm) -> None:
    """A barrier over ``comm`` that waits without spinning.

    The collectives below end with one: it keeps every member calling into MPI until all have
    finished. Open MPI can complete a small send once it is copied, while the message still waits
    behind the first TCP handshake with that peer; a rank that then left for a long gloo/NCCL wait
    would leave it undelivered. The barrier's own messages take pairs its earlier rounds connected.
    """
    wait_quietly([comm.Ibarrier()])


# mpi4py's object collectives (comm.bcast, ...) are blocking; these pickle into byte buffers and use MPI's
# non-blocking collectives instead, a size exchange first.
def _pickled(obj: Any) -> np.ndarray:
    return np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)


def _unpickled(buffer: np.ndarray, sizes: np.ndarray) -> list[Any]:
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(buffer[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(sizes))]


def bcast(comm: MPI.Comm, obj: Any, root: int) -> Any:
    """``root``'s object to every member of ``comm``."""
    mine = comm.Get_rank() == root
    data = _pickled(obj) if mine else np.empty(0, dtype=np.uint8)  # elsewhere: sized once the size is in
    size = np.array([data.size], dtype=np.int64)
    wait_quietly([comm.Ibcast(size, root=root)])
    if not mine:
        data = np.empty(int(size[0]), dtype=np.uint8)
    wait_quietly([comm.Ibcast(data, root=root)])
    arrive(comm)
    return obj if mine else pickle.loads(data.tobytes())


def gather(comm: MPI.Comm, obj: Any, root: int) -> list[Any] | None:
    """Every member's object, in rank order, at ``root`` (None elsewhere)."""
    # lazy: importing mpi4py initialises MPI; `restage generate`'s launcher imports this module and is no MPI rank
    from mpi4py import MPI

    mine = comm.Get_rank() == root
    data = _pickled(obj)
    sizes = np.zeros(comm.Get_size() if mine else 0, dtype=np.int64)
    wait_quietly([comm.Igather(np.array([data.size], dtype=np.int64), sizes if mine else None, root=root)])
    buffer = np.empty(int(sizes.sum()), dtype=np.uint8) if mine else None
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if mine else None
    wait_quietly([comm.Igatherv(data, [buffer, sizes, offsets, MPI.BYTE] if mine else None, root=root)])
    arrive(comm)
    return _unpickled(buffer, sizes) if buffer is not None else None  # buffer: root's alone


def allgather(comm: MPI.Comm, obj: Any) -> list[Any]:
    """Every member's object, in rank order, everywhere."""
    # lazy: importing mpi4py initialises MPI; `restage generate`'s launcher imports this module and is no MPI rank
    from mpi4py import MPI

    data = _pickled(obj)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    wait_quietly([comm.Iallgather(np.array([data.size], dtype=np.int64), sizes)])
    buffer = np.empty(int(sizes.sum()), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    wait_quietly([comm.Iallgatherv(data, [buffer, sizes, offsets, MPI.BYTE])])
    arrive(comm)
    return _unpickled(buffer, sizes)


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
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank() % torch.cuda.device_count())
    address = None
    if control.is_master:
        address = (os.environ.get("RESTAGE_RENDEZVOUS_HOST") or socket.gethostname(), free_port())
    host, port = control.bcast(address)
    startup = timeout_seconds if startup_timeout_seconds is None else startup_timeout_seconds
    # NCCL: naming the rank's device binds the communicator to the device set above (else torch guesses
    # global rank % device count, wrong when a node runs fewer ranks than it has GPUs, and warns); init is eager.
    device_id = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=control.rank,
                            world_size=control.world_size, timeout=datetime.timedelta(seconds=startup),
                            device_id=device_id)
    warm_world()
    set_world_timeout(timeout_seconds)
    return backend


def set_world_timeout(timeout_seconds: float) -> None:
    """The world group's timeout for every later op (NCCL's watchdog); start-up ran under its own."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_seconds))  # no public setter


_ready_rounds: dict[tuple[int, ...], int] = {}


def wait_for_ranks(ranks: Iterable[int], timeout_seconds: float) -> None:
    """Return once every rank of ``ranks`` has called this (in the same order on each): a barrier over the store.

    Run before a transfer whose ranks may still be in a long step, so NCCL's watchdog (counted
    from when an op is queued) only times the transfer; the wait itself is bounded by
    ``timeout_seconds`` and no communicator is involved.
    """
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
