"""What reallocation puts on the wire, counted on 4 real gloo ranks: one group per plan, batched P2P only."""

from __future__ import annotations

import pytest
import torch
from realloc_cases import L, reference_state, shard_of, tiny

from restage.layout import ProcessGroups
from restage.runtime.control.spawn import spawn
from restage.runtime.dataplane.realloc import execute_reallocation, groups_for
from restage.schedule.realloc_plan import plan_reallocation

pytestmark = pytest.mark.multirank

# A broadcast to three receivers, a tp change with a shared receiver set, and a pair on two ranks only.
PAIRS = [(L((0,)), L(range(4), dp=4)), (L(range(4), tp=4), L(range(1, 4), tp=3)), (L((2,)), L((3,)))]


def _plans():
    return [plan_reallocation(tiny(), a, b, bytes_per_element=4, world_size=4) for a, b in PAIRS]


def _count(rank: int, world_size: int) -> list[dict]:
    from comm_hook.comm_counter import install

    seen = install()
    full = reference_state(tiny())
    groups = ProcessGroups(groups_for(*_plans()))
    created = list(seen["groups"])
    out = []
    for plan in _plans():
        for key in ("batched", "unbatched", "p2p_groups"):
            seen[key].clear()
        result = execute_reallocation(plan, shard_of(tiny(), plan.src, rank, full) or None, groups,
                                      dtype=torch.float32, bucket_bytes=4096, direct_min_bytes=2048)
        exact = all(torch.equal(t, full[n][s.index()]) for n, t, s in _with_specs(plan, rank, result.state))
        out.append(dict(created=created, batched=sorted(seen["batched"]), unbatched=sorted(seen["unbatched"]),
                        p2p_groups=sorted(seen["p2p_groups"]), exact=exact))
    return out


def _with_specs(plan, rank, state):
    from restage.models.sharding import shard_specs

    coord = plan.dst.coord(rank)
    if coord is None:
        return []
    return [(s.param.name, state[s.param.name], s) for s in shard_specs(tiny(), plan.dst.strategy, coord.pp, coord.tp)]


def test_each_reallocation_runs_batched_on_its_one_group_of_src_and_dst():
    results = spawn(_count, 4, timeout_seconds=300)
    plans = _plans()
    # The groups made up front: one per plan (its src | dst ranks), not one per (sender, receivers).
    assert results[0][0]["created"] == [[0, 1, 2, 3], [2, 3]]
    for i, plan in enumerate(plans):
        links = {tuple(sorted(link)) for link in plan.bytes_by_link}
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            assert r["exact"], (i, rank)
            assert r["unbatched"] == [], (i, rank)  # unbatched NCCL send/recv would be a communicator per pair
            if rank in plan.ranks and any(rank in link for link in links):
                assert r["p2p_groups"] == [plan.ranks], (i, rank)
            assert {tuple(p) for p in r["batched"]} <= links
        assert {tuple(p) for per_rank in results for p in per_rank[i]["batched"]} == links
