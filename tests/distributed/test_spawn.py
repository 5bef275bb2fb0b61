import pytest
import torch
import torch.distributed as dist

from restage.errors import RankFailure
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


def test_ranks_meet_in_a_collective():
    assert spawn(_all_reduce, 3) == [6.0, 6.0, 6.0]


def test_a_failing_rank_is_named():
    with pytest.raises(RankFailure, match="rank 1 failed: ValueError: boom"):
        spawn(_fail_on_one, 2, timeout_seconds=60)
