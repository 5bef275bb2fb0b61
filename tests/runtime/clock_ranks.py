"""Run under mpirun: each rank's clock is skewed by rank * SKEW seconds; rank 0 writes the offsets every rank measured."""

import json
import sys
import time

from mpi4py import MPI

from restage.runtime.control.clock import measure_offset

SKEW_SECONDS = 37.5



def main(out_path: str) -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    offset = measure_offset(comm, local_clock=lambda: time.time() + rank * SKEW_SECONDS)
    offsets = comm.gather(offset, root=0)
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump(offsets, out)


if __name__ == "__main__":  # the test imports SKEW_SECONDS: importing must not measure, nor write to pytest's argv
    main(sys.argv[1])
