"""The reallocation planner, checked by applying its pieces to real tensors in one process."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
from realloc_cases import PAIRS_8, L, node_of_3, reference_state, shard_of, tiny

from restage.errors import LayoutError, PlanError
from restage.models.sharding import param_specs, shard_specs
from restage.schedule.realloc_plan import plan_reallocation, realloc_groups
from restage.schedule.realloc_rounds import SLOTS, schedule_messages, schedule_rounds


def _view(t: torch.Tensor, dim: int, rng: tuple[int, int]) -> torch.Tensor:
    return t.narrow(dim, rng[0], rng[1] - rng[0])


def _masks(cfg, layout, rank):
    """Boolean masks over the full parameters: which elements ``rank`` holds in ``layout``."""
    coord = layout.coord(rank)
    out = {s.name: torch.zeros(s.shape, dtype=torch.bool) for s in param_specs(cfg)}
    if coord is not None:
        for shard in shard_specs(cfg, layout.strategy, coord.pp, coord.tp):
            out[shard.param.name][shard.index()] = True
    return out


def _brute_lower_bound(cfg, src, dst, bytes_per_element):
    total = 0
    for rank in dst.mesh:
        have, want = _masks(cfg, src, rank), _masks(cfg, dst, rank)
        names = {s.param.name for s in shard_specs(cfg, dst.strategy, dst.coord(rank).pp, dst.coord(rank).tp)}
        total += sum(int((want[n] & ~have[n]).sum()) for n in names)
    return total * bytes_per_element


def _apply(plan, full):
    """Run the plan on one process: every destination shard built from the source shards only."""
    cfg, src, dst = plan.cfg, plan.src, plan.dst
    shards = {r: shard_of(cfg, src, r, full) for r in src.mesh}
    out, hits = {}, {}
    for r in dst.mesh:
        c = dst.coord(r)
        out[r] = {s.param.name: torch.full(s.shape, float("nan")) for s in shard_specs(cfg, dst.strategy, c.pp, c.tp)}
        hits[r] = {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in out[r].items()}
    for p in plan.local_pieces + plan.pieces:
        block = _view(shards[p.src_rank][p.name], p.dim, p.src_range)
        assert block.shape == _view(torch.empty(p.dst_shape), p.dim, p.dst_range).shape
        for r in p.dst_ranks:
            _view(out[r][p.name], p.dim, p.dst_range).copy_(block)
            _view(hits[r][p.name], p.dim, p.dst_range).add_(1)
    return out, hits


@pytest.mark.parametrize("kind,src,dst,what", PAIRS_8, ids=[c[3] for c in PAIRS_8])
def test_plan_builds_every_destination_shard_exactly_once(kind, src, dst, what):
    cfg = tiny(kind)
    full = reference_state(cfg)
    for a, b in ((src, dst), (dst, src)):
        plan = plan_reallocation(cfg, a, b, bytes_per_element=4, node_of=node_of_3, world_size=8)
        out, hits = _apply(plan, full)
        for r in b.mesh:
            expected = shard_of(cfg, b, r, full)
            assert out[r].keys() == expected.keys()
            for name, tensor in expected.items():
                assert torch.equal(out[r][name], tensor), (r, name)
                assert bool((hits[r][name] == 1).all()), (r, name)
        assert plan.total_bytes == plan.lower_bound_bytes == _brute_lower_bound(cfg, a, b, 4)
        assert sum(p.numel for p in plan.pieces if plan.dst.coord(p.src_rank) is None) * 4 <= plan.total_bytes
        for p in plan.pieces:
            assert p.src_rank not in p.dst_ranks and p.src_rank in a.mesh
            assert all(node_of_3(r) == node_of_3(p.src_rank) for r in p.dst_ranks) or not any(
                node_of_3(h) == node_of_3(p.dst_ranks[0]) for h in _holders(cfg, a, p))


def _holders(cfg, layout, piece):
    return [r for r in layout.mesh
            if any(s.param.name == piece.name and (s.param.split_dim is None or
                                                   s.start <= piece.full_range[0] < s.stop)
                   for s in shard_specs(cfg, layout.strategy, layout.coord(r).pp, layout.coord(r).tp))]


def test_equal_layouts_move_nothing():
    cfg = tiny()
    layout = L(range(4), dp=2, tp=2)
    plan = plan_reallocation(cfg, layout, layout, bytes_per_element=2)
    assert plan.pieces == () and plan.total_bytes == plan.lower_bound_bytes == 0
    assert plan.local_bytes == sum(sum(t.numel() for t in shard_of(cfg, layout, r, reference_state(cfg)).values())
                                   for r in layout.mesh) * 2


def test_dp_replicas_share_the_sending():
    cfg = tiny()
    plan = plan_reallocation(cfg, L(range(4), dp=4), L(range(4, 8), dp=4), bytes_per_element=4)
    sent = plan.sent_bytes_by_rank()
    # Four replicas, four receivers on one node: every sender serves one receiver per piece.
    assert sorted(sent) == [0, 1, 2, 3]
    assert max(sent.values()) == min(sent.values()) == plan.total_bytes // 4
    assert all(len(p.dst_ranks) == 1 for p in plan.pieces)
    # Two replicas, one receiver: the pieces alternate between the replicas.
    plan = plan_reallocation(cfg, L(range(2), dp=2), L((2,)), bytes_per_element=4)
    sent = plan.sent_bytes_by_rank()
    assert sorted(sent) == [0, 1] and abs(sent[0] - sent[1]) <= max(p.numel for p in plan.pieces) * 4


def test_senders_on_the_same_node_are_preferred():
    cfg = tiny()
    node_of = {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}.__getitem__  # odd ranks on node 1, even on node 0
    plan = plan_reallocation(cfg, L((0, 1), dp=2), L((2, 3, 4, 5), dp=4), bytes_per_element=4, node_of=node_of)
    assert plan.bytes_by_link.keys() == {(0, 2), (0, 4), (1, 3), (1, 5)}
    # A node without any holder takes every piece once from a remote sender, as one broadcast.
    plan = plan_reallocation(cfg, L((0,)), L((2, 4), dp=2), bytes_per_element=4, node_of=lambda r: r // 2)
    assert all(p.dst_ranks == (2,) for p in plan.pieces if 2 in p.dst_ranks)


def test_tp_that_does_not_divide_heads_is_refused_in_one_line():
    with pytest.raises(LayoutError) as err:
        plan_reallocation(tiny("qwen2"), L(range(2), tp=2), L(range(4), tp=4), bytes_per_element=2)
    assert "tp=4 does not divide 12 attention heads and 6 KV heads" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(LayoutError, match="pp=5 is larger than its 4 layers"):
        plan_reallocation(tiny(), L(range(2), tp=2), L(range(5), pp=5), bytes_per_element=2)


def test_ranks_outside_the_world_are_refused_in_one_line():
    with pytest.raises(LayoutError) as err:
        plan_reallocation(tiny(), L(range(2), tp=2), L(range(6, 10), tp=4), bytes_per_element=2, world_size=8)
    assert "uses ranks [8, 9] but only 8 ranks exist" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("bucket_bytes,direct_min_bytes,by_unit", [(1024, 1 << 30, True), (4096, 2048, False),
                                                                   (4096, 2048, True), (1 << 20, 0, False)])
def test_transfers_fit_the_bucket_and_cover_each_piece(bucket_bytes, direct_min_bytes, by_unit):
    cfg = tiny("gpt2")
    plan = plan_reallocation(cfg, L(range(4), tp=4), L(range(2, 8), dp=2, tp=3), bytes_per_element=4)
    transfers = schedule_messages(plan, bucket_bytes, direct_min_bytes, by_unit=by_unit)
    covered = defaultdict(int)
    for t in transfers:
        # A side is in place only for one piece contiguous on that side; a bucket packs both sides.
        assert (t.send_in_place, t.receive_in_place) == ((t.pieces[0].src_contiguous(), t.pieces[0].dst_contiguous())
                                                         if len(t.pieces) == 1 and (t.send_in_place or t.receive_in_place)
                                                         else (False, False))
        if t.send_in_place or t.receive_in_place:
            assert t.numel * 4 >= direct_min_bytes
        if t.packed:
            assert t.numel * 4 <= bucket_bytes
        for p in t.pieces:
            assert (p.src_rank, p.dst_ranks, p.unit if by_unit else 0) == (t.src_rank, t.dst_ranks, t.unit)
            covered[(p.name, p.src_rank, p.dst_ranks)] += p.numel
    expected = defaultdict(int)
    for p in plan.pieces:
        expected[(p.name, p.src_rank, p.dst_ranks)] += p.numel
    assert covered == expected
    # Stage by stage; inside a stage the in-place transfers come before the buckets.
    assert [(t.unit, t.packed) for t in transfers] == sorted((t.unit, t.packed) for t in transfers)
    buckets = [t for t in transfers if not (t.send_in_place or t.receive_in_place)]
    channels = {(t.src_rank, t.dst_ranks) for t in buckets}
    if not by_unit:  # buckets span units: at most one partly filled bucket per channel
        assert len(buckets) <= len(channels) + sum(t.numel for t in buckets) * 4 // bucket_bytes
    assert realloc_groups(plan) == [tuple(range(8))]  # one group, src | dst, whatever the receivers
    with pytest.raises(PlanError, match="exceeds the bucket"):
        schedule_messages(plan, 64, 1 << 30)


@pytest.mark.parametrize("bucket_bytes", [4096, 16384, 1 << 20])
def test_rounds_keep_the_global_order_stay_in_a_stage_and_fill_at_most_half_a_bucket(bucket_bytes):
    """Every rank cuts its batches where every other does (else two batches could wait on each other)."""
    plan = plan_reallocation(tiny("gpt2"), L(range(4), tp=4), L(range(2, 8), dp=2, tp=3), bytes_per_element=4)
    rounds = schedule_rounds(plan, bucket_bytes, 2048)
    assert [t for r in rounds for t in r.messages] == list(schedule_messages(plan, bucket_bytes // SLOTS, 2048))
    for r in rounds:
        assert {t.unit for t in r.messages} == {r.unit}
        assert len({t.packed for t in r.messages}) == 1  # in place on both sides, or not: never mixed
        assert all(r.packed_numel(rank) * 4 <= bucket_bytes // 2 for rank in range(8))
    # Rounds are as few as the rule allows: each new one starts a stage or would have overflowed someone's half.
    for before, after in zip(rounds, rounds[1:]):
        t = after.messages[0]
        packers = [x for x in (t.src_rank, *t.dst_ranks) if not t.in_place_for(x)]
        assert before.unit != after.unit or before.messages[-1].packed != t.packed or any(
            (before.packed_numel(x) + t.numel) * 4 > bucket_bytes // 2 for x in packers)
