"""Run a function on N real processes joined by torch.distributed (gloo on CPU, NCCL on GPUs).

Used by the multi-rank tests and the benchmarks; the production entry point is
``restage.runtime.spmd`` under mpirun. Each process gets a fresh interpreter (spawn), so no
state leaks between ranks. A rank that raises makes ``spawn`` raise RankFailure naming it;
a rank that hangs past ``timeout_seconds`` gets every process killed.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from restage.errors import RankFailure

if TYPE_CHECKING:
    from multiprocessing.queues import Queue


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # (host, port)


def init_process_group(rank: int, world_size: int, port: int, backend: str | None = None,
                       timeout_seconds: float = 120.0) -> None:
    """Join the default group (NCCL when CUDA is available, gloo otherwise) and warm it; see ``warm_world``."""
    # lazy: the launcher imports this module (free_port) and runs without torch
    import torch
    import torch.distributed as dist

    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=timeout_seconds))
    warm_world()


def warm_world() -> None:
    """Turn on NCCL's rules when asked (``nccl_rules``), then run the world's first collective with every rank.

    With NCCL a batched P2P that is a group's first call must involve every rank of the group;
    after this barrier a pipeline may exchange over the world among a few ranks. The barrier also
    makes start-up (peers still importing or loading) end here, under the start-up timeout.
    """
    # lazy: the launcher imports this module (free_port) and runs without torch
    import torch.distributed as dist

    from restage.testing import nccl_rules

    nccl_rules.install()
    dist.barrier()


def _worker(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple[Any, ...],
            results: Queue[tuple[int, str, Any]], env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    try:
        # lazy: the launcher imports this module (free_port) and runs without torch
        import torch

        torch.set_num_threads(1)
        init_process_group(rank, world_size, port)
        # Plain pickle copies tensor data; the queue's own pickler would share it through
        # shared memory that disappears when this process exits.
        value = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, "ok", value))
        # lazy: the launcher imports this module (free_port) and runs without torch
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    except BaseException as err:  # report every failure, including SystemExit, to the parent
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout_seconds: float = 300.0,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the values by rank.

    ``fn`` must be importable (a module-level function) and its return value picklable.
    """
    ctx = mp.get_context("spawn")
    results: Queue[tuple[int, str, Any]] = ctx.Queue()  # (rank, "ok" or "error", pickled value or traceback)
    port = free_port()
    # Every spawned rank checks NCCL's rules unless the caller says otherwise (RESTAGE_NCCL_RULES=0).
    env = {"OMP_NUM_THREADS": "1", "RESTAGE_NCCL_RULES": os.environ.get("RESTAGE_NCCL_RULES", "1"), **(env or {})}
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results, env), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_seconds
    try:
        while len(values) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in values]
                if dead:
                    raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RankFailure(f"ranks {sorted(set(range(world_size)) - set(values))} did not finish "
                                      f"within {timeout_seconds:.0f} s") from None
                continue
            if status == "error":
                raise RankFailure(f"rank {rank} failed: {value}")
            values[rank] = pickle.loads(value)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return [values[r] for r in range(world_size)]
