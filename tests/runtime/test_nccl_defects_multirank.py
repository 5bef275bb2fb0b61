"""Three defects NCCL would expose, caught on gloo by the NCCL rules layer (restage.testing.nccl_rules).

* pipeline exchange: a batched P2P on the world among two of four ranks as the world's first call;
* a DP all-reduce of tensors ``prepare_train`` computed on the host;
* a reallocation whose senders arrive later than the data-plane timeout.
"""

from __future__ import annotations

import time

import pytest
import torch
from realloc_cases import L, reference_state, shard_of, tiny

from restage.layout import ProcessGroups
from restage.runtime.control.spawn import spawn
from restage.runtime.dataplane.realloc import groups_for
from restage.schedule.realloc_plan import plan_reallocation
from restage.testing import nccl_rules

pytestmark = pytest.mark.multirank


def _pipeline_pair(rank, world_size):
    from restage.models.pipeline import recv_tensor, send_tensor

    if rank == 0:
        send_tensor(torch.arange(4.0), 1)
    elif rank == 1:
        return recv_tensor(torch.zeros(4), 0).tolist()
    return None


def test_pipeline_exchange_among_two_of_four_ranks_passes_nccl_rules():
    """Stages 0 and 1 exchange over the world while ranks 2 and 3 are elsewhere (warm_world makes it legal)."""
    assert spawn(_pipeline_pair, 4, timeout_seconds=180) == [None, [0.0, 1.0, 2.0, 3.0], None, None]


def _dp_reduce_host_tensor(rank, world_size):
    from restage.runtime.step.op_handlers import dp_reducer

    groups = ProcessGroups([(0, 1)])
    reduce = dp_reducer(groups.get((0, 1)), nccl_rules.rank_device())
    host = torch.tensor([rank + 1.0, 10.0]).cpu()  # as prepare_train gets it: dataflow keeps batches on the host
    out = reduce(host)
    return out.tolist(), type(out).__name__, host.tolist()


def test_dp_reduce_of_host_tensors_runs_on_the_rank_device():
    out = spawn(_dp_reduce_host_tensor, 2, timeout_seconds=180, env={"RESTAGE_NCCL_RULES": "device"})
    assert out == [([3.0, 20.0], "HostTensor", [1.0, 10.0]), ([3.0, 20.0], "HostTensor", [2.0, 10.0])]


SENDERS_LATE_SECONDS = 6.0
DATA_PLANE_TIMEOUT_SECONDS = 3.0


def _late_senders(rank, world_size):
    from restage.runtime.control.channels import set_world_timeout
    from restage.runtime.step.op_handlers import reallocate_when_ready

    set_world_timeout(DATA_PLANE_TIMEOUT_SECONDS)  # unbatched P2P runs on the world group
    cfg = tiny()
    src, dst = L((0, 1), tp=2), L((2,))
    plan = plan_reallocation(cfg, src, dst, bytes_per_element=4, world_size=world_size)
    groups = ProcessGroups(groups_for(plan), timeout_seconds=DATA_PLANE_TIMEOUT_SECONDS)
    full = reference_state(cfg)
    if rank in src.mesh:
        time.sleep(SENDERS_LATE_SECONDS)  # still finishing a long generate or train step
    begin = time.monotonic()
    result = reallocate_when_ready(plan, shard_of(cfg, src, rank, full) or None, groups, peer_wait_timeout_seconds=120,
                                   dtype=torch.float32)
    waited = time.monotonic() - begin
    if rank in dst.mesh:
        return sorted(result.state) == sorted(full) and all(torch.equal(result.state[k], full[k]) for k in full), waited
    return None, waited


def test_reallocation_with_senders_later_than_the_timeout_passes():
    out = spawn(_late_senders, 3, timeout_seconds=240)
    assert [same for same, _ in out] == [None, None, True]
    assert out[2][1] >= SENDERS_LATE_SECONDS - 1.0  # the receiver did wait, longer than the data-plane timeout
