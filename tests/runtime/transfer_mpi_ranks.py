"""Run under mpirun (8 ranks): every data-transfer case over ``MpiChannel`` on each case's own sub-communicator.

Rank 0 writes, to the path given, what every rank received and counted (checked by test_transfer_mpi_multirank).
"""

from __future__ import annotations

import json
import sys

import torch
from mpi4py import MPI
from transfer_cases import TRANSFERS_8, make_meta, producer_batch, sample_batch

from restage.data.batch import concat
from restage.runtime.dataplane.data_transfer import MpiChannel, execute_transfer, plan_transfer


def main(path: str) -> None:
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    out = []
    for i, (prod, cons, stages, n, group, _) in enumerate(TRANSFERS_8):
        # The transfer's members in the dataflow's order (producer mesh, then the consumer's new ranks).
        members = list(dict.fromkeys((*prod.mesh, *cons.mesh)))
        members_group = world.Get_group().Incl(members)
        comm = world.Create_group(members_group, tag=i + 1)
        members_group.Free()
        if rank not in members:
            out.append(None)
            continue
        plan = plan_transfer(make_meta(i, n, prod.strategy.dp, group), prod, cons, consumer_stages=stages,
                             world_size=8, assignment="contiguous", node_of=lambda r: r // 3)
        meta = plan.meta
        part = next((d for d, ranks in enumerate(plan.holders) if rank in ranks), None)
        result = execute_transfer(plan, producer_batch(meta, part) if part is not None else None,
                                  MpiChannel(comm, members), rank)
        comm.Free()
        consumer = next((d for d, ranks in enumerate(plan.receivers) if rank in ranks), None)
        wrong = []
        if consumer is not None and plan.assignment[consumer]:
            want = concat([sample_batch(meta.sample_ids[j], meta.sample_seqlens(j), meta.group_size)
                           for j in plan.assignment[consumer]])
            wrong = [k for k in want.keys() if not torch.equal(result.batch[k], want[k])]
            wrong += [] if result.batch.seqlens == want.seqlens else ["seqlens"]
        out.append({"wrong": wrong, "samples": [] if consumer is None else list(plan.assignment[consumer]),
                    "sent": [[s, d, b] for (s, d), b in result.sent_bytes_by_link.items()],
                    "received": [[s, d, b] for (s, d), b in result.received_bytes_by_link.items()]})
    everyone = world.gather(out, root=0)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main(sys.argv[1])
