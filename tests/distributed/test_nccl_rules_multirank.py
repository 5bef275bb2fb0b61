"""The NCCL rules layer: for each rule, a program that breaks it fails naming the rule, and the same program done right passes."""

import pytest
import torch
import torch.distributed as dist

from restage.errors import RankFailure
from restage.runtime.control.spawn import spawn
from restage.testing import host_tensors, nccl_rules

pytestmark = pytest.mark.multirank


def _batched_first(rank, world_size, warm):
    group = dist.new_group([0, 1, 2])
    if warm:  # done right: a collective by every rank of the group first
        dist.barrier(group=group)
    if rank in (0, 1):
        buffer = torch.zeros(2)
        peer = 1 - rank
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), peer, group=group),
               dist.P2POp(dist.irecv, buffer, peer, group=group)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        return buffer.tolist()
    return None


def test_batched_p2p_first_on_a_group_needs_all_its_ranks():
    with pytest.raises(RankFailure, match=r"rule 'first-batched-p2p' broken on rank [01], group ranks 0,1,2, "
                                          r"op batch_isend_irecv"):
        spawn(_batched_first, 3, False, timeout_seconds=120)
    assert spawn(_batched_first, 3, True, timeout_seconds=120) == [[1.0, 1.0], [0.0, 0.0], None]


def _exchange(rank, world_size, crossing):
    peer = 1 - rank
    mine, theirs = torch.full((3,), float(rank)), torch.zeros(3)
    if crossing or rank == 0:
        dist.send(mine, peer)
        dist.recv(theirs, peer)
    else:
        dist.recv(theirs, peer)
        dist.send(mine, peer)
    nccl_rules.check()
    return theirs.tolist()


def test_crossing_unbatched_sends_are_caught():
    with pytest.raises(RankFailure, match=r"rule 'crossing-p2p' broken on rank [01], group world, op send #0"):
        spawn(_exchange, 2, True, timeout_seconds=120)
    assert spawn(_exchange, 2, False, timeout_seconds=120) == [[1.0] * 3, [0.0] * 3]


def _reduce(rank, world_size, stray_cpu):
    device = nccl_rules.rank_device()
    assert device == torch.device("cpu", 0) and host_tensors.same_device(torch.zeros(1).device, device)
    values = torch.arange(3.0).to(device) + rank
    if stray_cpu:
        values = values.cpu() * 1  # the mark survives arithmetic
    dist.all_reduce(values)
    return values.tolist()


def test_a_host_tensor_in_a_collective_is_caught():
    env = {"RESTAGE_NCCL_RULES": "device"}
    with pytest.raises(RankFailure, match=r"rule 'device' broken on rank [01], group world, op all_reduce"):
        spawn(_reduce, 2, True, timeout_seconds=120, env=env)
    assert spawn(_reduce, 2, False, timeout_seconds=120, env=env) == [[1.0, 3.0, 5.0]] * 2


def _many(rank, world_size, groups, pairs):
    nccl_rules.set_bound(max_groups=2, max_pairs=1)
    for _ in range(groups):
        dist.new_group([0, 1])
    buffer = torch.zeros(1)
    for peer in range(pairs):
        other = (rank + 1 + peer) % world_size
        source = (rank - 1 - peer) % world_size
        if rank % 2 == 0:
            dist.send(torch.ones(1), other)
            dist.recv(buffer, source)
        else:
            dist.recv(buffer, source)
            dist.send(torch.ones(1), other)
    nccl_rules.check()
    return buffer.item()


def test_more_communicators_than_the_bound_are_caught():
    with pytest.raises(RankFailure, match=r"rule 'bound' broken on rank [01], .*3 communicators exceed the bound of 2"):
        spawn(_many, 2, 2, 0, timeout_seconds=120)
    with pytest.raises(RankFailure, match=r"rule 'bound' broken on rank \d, .*P2P rank pairs .* exceed the bound of 1"):
        spawn(_many, 4, 1, 1, timeout_seconds=120)
    assert spawn(_many, 2, 1, 1, timeout_seconds=120) == [1.0, 1.0]


def _plain(rank, world_size):
    return nccl_rules.enabled(), torch.zeros(1).cpu().__class__.__name__, dist.all_reduce.__module__


def test_the_layer_is_free_when_off():
    off = spawn(_plain, 2, env={"RESTAGE_NCCL_RULES": "0"}, timeout_seconds=120)
    assert off == [(False, "Tensor", "torch.distributed.distributed_c10d")] * 2
    on = spawn(_plain, 2, env={"RESTAGE_NCCL_RULES": "device"}, timeout_seconds=120)
    assert on == [(True, "HostTensor", "restage.testing.nccl_rules")] * 2
