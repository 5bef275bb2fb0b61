"""One clock for every rank's timestamps, and timings that wait for the device.

Nodes' clocks differ (NTP keeps them within milliseconds when it runs; a node without it can be
seconds off), while the report's timeline subtracts one rank's timestamps from another's. At
start-up each rank measures its offset to the master's clock over MPI (Cristian's method: the
master answers pings with its time; of several rounds the one with the shortest round trip
counts, its reply assumed read halfway through) and stamps everything it reports on the
master's clock.

On a GPU the host runs ahead of the device: a timestamp taken right after launching kernels
says when they were queued, not when they ran. ``Clock.now_synced`` waits for the device first.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importing mpi4py initializes MPI; the caller holds the communicator
    from mpi4py import MPI

ROUNDS = 8
_PING, _PONG = 7301, 7302  # MPI tags of this exchange alone


def offset_from_rounds(rounds: list[tuple[float, float, float]]) -> float:
    """Master's clock minus this rank's, from (sent, master's time, received) triples of this rank's pings."""
    sent, master, received = min(rounds, key=lambda r: r[2] - r[0])
    return master - (sent + received) / 2


def measure_offset(comm: MPI.Comm, local_clock: Callable[[], float] = time.time, rounds: int = ROUNDS) -> float:
    """This rank's offset to rank 0's clock (0 on rank 0). Collective over ``comm``: every rank calls it."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        for peer in range(1, size):  # one peer at a time, so no reply waits behind another peer's ping
            for _ in range(rounds):
                comm.recv(source=peer, tag=_PING)
                comm.send(local_clock(), dest=peer, tag=_PONG)
        return 0.0
    samples = []
    for _ in range(rounds):
        sent = local_clock()
        comm.send(None, dest=0, tag=_PING)
        master = comm.recv(source=0, tag=_PONG)
        samples.append((sent, master, local_clock()))
    return offset_from_rounds(samples)


def device_sync(device: torch.device) -> Callable[[], None]:
    """A function that waits until ``device`` has run everything queued on it (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


class Clock:
    """Seconds on the master's clock, as this rank reads it."""

    def __init__(self, offset_seconds: float = 0.0, device: torch.device | None = None,
                 local_clock: Callable[[], float] = time.time):
        self.offset_seconds = offset_seconds
        self._local = local_clock
        self._sync = device_sync(device) if device is not None else (lambda: None)

    def now(self) -> float:
        return self._local() + self.offset_seconds

    def now_synced(self) -> float:
        """``now`` once the device has finished its queued work: the end (or start) of what ran on it."""
        self._sync()
        return self.now()


def peak_memory_bytes(device: torch.device) -> int:
    """This rank's peak memory since the last reset, including what lives outside PyTorch's allocator.

    On a GPU, ``max_memory_allocated`` misses the CUDA context and NCCL's buffers (NCCL allocates
    them itself, per communicator); they are read as the device's used memory minus what PyTorch
    has reserved, now, and added. On a CPU: the process's peak resident set.
    """
    if device.type == "cuda":
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        outside = (total_bytes - free_bytes) - torch.cuda.memory_reserved(device)
        return int(torch.cuda.max_memory_allocated(device) + max(0, outside))

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
