"""Run under mpirun (2 ranks): rank 0 waits in the control plane and in an MPI data transfer while rank 1
sleeps; rank 0 writes the CPU seconds it spent waiting to the path given (checked by test_quiet_wait_multirank)."""

from __future__ import annotations

import json
import sys
import time

import torch

from restage.runtime.control.channels import Control
from restage.runtime.dataplane.data_transfer import MpiChannel

LATE_SECONDS = 2.0


def timed(fn) -> dict[str, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return {"wall_seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu}


def main(path: str) -> None:
    control = Control()
    rank = control.rank
    late = (lambda: time.sleep(LATE_SECONDS)) if rank == 1 else (lambda: None)
    out = {}
    values = {}
    late()
    out["bcast"] = timed(lambda: values.setdefault("bcast", control.bcast({"ids": [3, 1]} if rank == 0 else None)))
    late()
    out["gather"] = timed(lambda: values.setdefault("gather", control.gather(("rank", rank, "x" * 1000 * rank))))
    late()
    out["allgather"] = timed(lambda: values.setdefault("allgather", control.allgather(None if rank else [rank])))
    late()
    out["barrier"] = timed(control.barrier)
    channel = MpiChannel(control.comm, [0, 1])
    buffer = torch.full((1024,), float(rank))
    late()
    if rank == 0:
        out["receive"] = timed(lambda: channel.exchange([], [(buffer, 1)]))
        out["received"] = buffer[0].item()
    else:
        channel.exchange([(buffer, 0)], [])
    everyone = control.gather(values)
    if rank == 0:
        out["values"] = everyone
        with open(path, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1])
