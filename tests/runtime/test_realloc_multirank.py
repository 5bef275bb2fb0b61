"""Reallocation and data transfer on real gloo processes: exact shards and batches, round trips, counted bytes, memory."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from realloc_cases import PAIRS_8, L, node_of_3, reference_state, shard_of, tiny
from transfer_cases import TRANSFERS_8, make_meta, producer_batch, sample_batch

from restage.data.batch import concat
from restage.errors import LayoutError
from restage.layout import ProcessGroups
from restage.models.packing import contiguous_parts
from restage.runtime.control.spawn import spawn
from restage.runtime.dataplane.data_transfer import GlooChannel, execute_transfer, plan_transfer
from restage.runtime.dataplane.realloc import Workspace, execute_reallocation, groups_for
from restage.schedule.realloc_plan import plan_reallocation
from restage.schedule.realloc_rounds import SLOTS, schedule_messages

pytestmark = pytest.mark.multirank

# Small buckets, so buckets fill, pieces are cut and packed and in-place transfers both run. Odd pairs
# use slots (a quarter bucket) large enough for pieces in place on one side only (sender or receivers).
SIZES = [(4096, 2048), (16384, 1024)]  # (bucket bytes, direct_min_bytes)


def _sizes(index: int) -> tuple[int, int]:
    return SIZES[index % 2]


def _dtype(index: int) -> torch.dtype:
    return torch.bfloat16 if index % 3 == 2 else torch.float32


def _mismatches(got: dict, expected: dict) -> list[str]:
    if got.keys() != expected.keys():
        return [f"keys {sorted(set(got) ^ set(expected))}"]
    return [n for n, t in expected.items() if not torch.equal(got[n], t)]


def _walk_pairs(rank: int, world_size: int, pairs: list) -> list[dict]:
    """Run every pair forwards and back; return what this rank saw, for the parent to check."""
    plans = []
    for i, (kind, a, b, _) in enumerate(pairs):
        cfg, bpe = tiny(kind), _dtype(i).itemsize
        plans.append((plan_reallocation(cfg, a, b, bytes_per_element=bpe, node_of=node_of_3, world_size=world_size),
                      plan_reallocation(cfg, b, a, bytes_per_element=bpe, node_of=node_of_3, world_size=world_size)))
    groups = ProcessGroups(groups_for(*(p for pair in plans for p in pair)))
    workspaces = {size: Workspace() for size in SIZES}  # kept across calls, as the runtime does (one per bucket size)
    out = []
    for i, ((kind, a, b, _), (forward, backward)) in enumerate(zip(pairs, plans)):
        cfg, dtype = tiny(kind), _dtype(i)
        bucket_bytes, direct_min_bytes = _sizes(i)
        full = reference_state(cfg, seed=i, dtype=dtype)
        original = shard_of(cfg, a, rank, full)
        there = execute_reallocation(forward, original or None, groups, dtype=dtype, bucket_bytes=bucket_bytes,
                                     direct_min_bytes=direct_min_bytes)
        # Backwards into caller-owned tensors (as into a model's parameters), filled in place.
        into = {n: torch.full_like(t, float("nan")) for n, t in original.items()}
        back = execute_reallocation(backward, there.state or None, groups, dtype=dtype, bucket_bytes=bucket_bytes,
                                    direct_min_bytes=direct_min_bytes, destination=into or None,
                                    workspace=workspaces[_sizes(i)])
        in_place = all(back.state[n].data_ptr() == t.data_ptr() for n, t in into.items())
        out.append(dict(
            forward_wrong=_mismatches(there.state, shard_of(cfg, b, rank, full)),
            back_wrong=_mismatches(back.state, original) + ([] if in_place else ["not filled in place"]),
            received=[there.stats.received_bytes_by_link, back.stats.received_bytes_by_link],
            sent=[there.stats.sent_bytes_by_link, back.stats.sent_bytes_by_link],
            peak=[there.stats.peak_extra_bytes, back.stats.peak_extra_bytes],
            shard=[there.stats.destination_shard_bytes, back.stats.destination_shard_bytes],
            buffer=[there.stats.peak_buffer_bytes, back.stats.peak_buffer_bytes],
        ))
    return out


def _check(pairs, results, world_size) -> Counter:
    """Check what every rank saw; return how many transfers of each kind ran (in place on which side)."""
    kinds = Counter()
    for i, (kind, a, b, what) in enumerate(pairs):
        cfg, bpe = tiny(kind), _dtype(i).itemsize
        bucket_bytes, direct_min_bytes = _sizes(i)
        for direction, (x, y) in enumerate(((a, b), (b, a))):
            plan = plan_reallocation(cfg, x, y, bytes_per_element=bpe, node_of=node_of_3, world_size=world_size)
            kinds.update((t.send_in_place, t.receive_in_place) for t in schedule_messages(
                plan, bucket_bytes // SLOTS, direct_min_bytes))
            received, sent = Counter(), Counter()
            for rank, per_rank in enumerate(results):
                r = per_rank[i]
                assert r["forward_wrong"] == [] and r["back_wrong"] == [], (what, rank, r)
                received.update(r["received"][direction])
                sent.update(r["sent"][direction])
                # The destination shard plus one bucket bounds what a rank held beyond its source.
                assert r["peak"][direction] <= r["shard"][direction] + bucket_bytes, (what, rank)
                assert r["buffer"][direction] <= bucket_bytes
            assert dict(received) == dict(sent) == {k: v for k, v in plan.bytes_by_link.items() if v}, what
            assert sum(received.values()) == plan.total_bytes == plan.lower_bound_bytes, what
    return kinds


def _walk_transfers(rank: int, world_size: int, assignment: str | None = None) -> list[dict]:
    """Run every data transfer case over the default gloo group (no group of its own); return what this rank
    received, checked against the regenerated samples. ``assignment="contiguous"`` cuts as the SPMD runtime does.
    """
    plans = [plan_transfer(make_meta(i, n, prod.strategy.dp, group), prod, cons, consumer_stages=stages,
                           world_size=world_size, assignment=assignment)
             for i, (prod, cons, stages, n, group, _) in enumerate(TRANSFERS_8)]
    dist.barrier()  # a collective first: batched sends are never the group's first call
    out = []
    for plan in plans:
        meta = plan.meta
        part = next((d for d, ranks in enumerate(plan.holders) if rank in ranks), None)
        result = execute_transfer(plan, producer_batch(meta, part) if part is not None else None, GlooChannel(), rank)
        consumer = next((d for d, ranks in enumerate(plan.receivers) if rank in ranks), None)
        wrong = []
        if consumer is not None:
            samples = plan.assignment[consumer]
            got = result.batch
            if samples:
                want = concat([sample_batch(meta.sample_ids[i], meta.sample_seqlens(i), meta.group_size) for i in samples])
                wrong = [k for k in want.keys() if k not in got or not torch.equal(got[k], want[k])]
                wrong += [] if (got.seqlens, got.ids) == (want.seqlens, want.ids) else ["seqlens or ids"]
            elif got.n_samples:
                wrong = ["samples where none were assigned"]
        out.append(dict(consumer=consumer, ids=None if result.batch is None else list(result.batch.ids), wrong=wrong,
                        sent=result.sent_bytes_by_link, received=result.received_bytes_by_link))
    return out


# Pairs where ranks keep whole tensors (layers of a pp stage or dp replica, replicated norms), for share_local.
SHARED = [0, 6, 8, 9, 18, 24, 30]


def _walk_shared(rank: int, world_size: int) -> list[dict]:
    """share_local: tensors a rank holds whole are the source's own storage, the rest as usual; into new and given tensors."""
    out = []
    for i in SHARED:
        kind, a, b, _ = PAIRS_8[i]
        cfg, dtype = tiny(kind), _dtype(i)
        plan = plan_reallocation(cfg, a, b, bytes_per_element=dtype.itemsize, node_of=node_of_3, world_size=world_size)
        groups = ProcessGroups(groups_for(plan))
        full = reference_state(cfg, seed=i, dtype=dtype)
        source = shard_of(cfg, a, rank, full)
        expected = shard_of(cfg, b, rank, full)
        given = {n: torch.full_like(t, float("nan")) for n, t in expected.items()}
        runs = [execute_reallocation(plan, source or None, groups, dtype=dtype, destination=into, share_local=True)
                for into in (None, given or None)]
        out.append(dict(
            wrong=[_mismatches(r.state, expected) for r in runs],
            # Which destination tensors are the source's own memory; a given tensor must be rebound, not replaced.
            shares=[sorted(n for n, t in r.state.items() if n in source and t.data_ptr() == source[n].data_ptr())
                    for r in runs],
            given_rebound=sorted(n for n, t in given.items() if n in source and t.data_ptr() == source[n].data_ptr()),
            shared_bytes=[r.stats.shared_bytes for r in runs], peak=[r.stats.peak_extra_bytes for r in runs],
            shard=runs[0].stats.destination_shard_bytes, local=[r.stats.local_bytes for r in runs],
            received=[r.stats.received_bytes for r in runs], buffer=runs[0].stats.peak_buffer_bytes,
        ))
    return out


def _eight_ranks(rank: int, world_size: int) -> dict:
    return {"realloc": _walk_pairs(rank, world_size, PAIRS_8), "transfer": _walk_transfers(rank, world_size),
            "contiguous": _walk_transfers(rank, world_size, "contiguous"), "shared": _walk_shared(rank, world_size)}


@pytest.fixture(scope="module")
def eight():
    """One spawn of 8 ranks runs every reallocation pair and every data transfer case."""
    return spawn(_eight_ranks, 8, timeout_seconds=600)


def test_32_layout_pairs_on_8_ranks_are_exact_and_move_only_the_lower_bound(eight):
    assert len(PAIRS_8) >= 30
    results = [r["realloc"] for r in eight]
    kinds = _check(PAIRS_8, results, 8)
    # Every way of moving a piece ran: in place on both sides, on one side only (either), and buckets.
    assert set(kinds) == {(True, True), (True, False), (False, True), (False, False)}, kinds
    assert any(b for per_rank in results for r in per_rank for b in r["buffer"])


def test_share_local_makes_whole_local_tensors_the_sources_own_and_copies_nothing_for_them(eight):
    shared_somewhere = 0
    for j, i in enumerate(SHARED):
        kind, a, b, what = PAIRS_8[i]
        dtype = _dtype(i)
        plan = plan_reallocation(tiny(kind), a, b, bytes_per_element=dtype.itemsize, node_of=node_of_3, world_size=8)
        received = 0
        for rank, per_rank in enumerate(eight):
            r = per_rank["shared"][j]
            assert r["wrong"] == [[], []], (what, rank)
            whole = sorted(p.name for p in plan.local_pieces if p.src_rank == rank and p.whole)
            assert r["shares"] == [whole, whole] and r["given_rebound"] == whole, (what, rank)
            nbytes = sum(p.numel for p in plan.local_pieces if p.src_rank == rank and p.whole) * dtype.itemsize
            local = sum(p.numel for p in plan.local_pieces if p.src_rank == rank) * dtype.itemsize
            assert r["shared_bytes"] == [nbytes, nbytes] and r["local"] == [local, local], (what, rank)
            # A new destination holds no memory for the shared tensors.
            assert r["peak"][0] <= r["shard"] - nbytes + r["buffer"], (what, rank)
            received += r["received"][0]
            shared_somewhere += nbytes
        assert received == plan.total_bytes, what  # sharing moves nothing more or less
    assert shared_somewhere > 0


def test_data_transfer_delivers_each_sample_once_intact_and_balanced(eight):
    for i, (prod, cons, stages, n, group, what) in enumerate(TRANSFERS_8):
        meta = make_meta(i, n, prod.strategy.dp, group)
        plan = plan_transfer(meta, prod, cons, consumer_stages=stages, world_size=8)
        seen = {}
        received, sent = Counter(), Counter()
        for rank, per_rank in enumerate(eight):
            r = per_rank["transfer"][i]
            assert r["wrong"] == [], (what, rank, r["wrong"])
            received.update(r["received"])
            sent.update(r["sent"])
            if r["consumer"] is not None:
                # Every receiver of a consumer DP rank (its TP ranks, on the stages asked for) got the same samples.
                seen.setdefault(r["consumer"], r["ids"])
                assert r["ids"] == seen[r["consumer"]], what
        assert sorted(i for ids in seen.values() for i in ids) == sorted(meta.sample_ids), what
        loads = [sum(meta.sample_tokens(meta.sample_ids.index(s)) for s in ids) for ids in seen.values()]
        assert max(loads) - min(loads) <= max(meta.sample_tokens(j) for j in range(n)), what
        assert dict(received) == dict(sent) == plan.bytes_by_link, what


def test_contiguous_data_transfer_gives_each_consumer_its_run_of_the_global_order(eight):
    for i, (prod, cons, stages, n, group, what) in enumerate(TRANSFERS_8):
        meta = make_meta(i, n, prod.strategy.dp, group)
        want = contiguous_parts([meta.sample_tokens(j) for j in range(n)], cons.strategy.dp)
        plan = plan_transfer(meta, prod, cons, consumer_stages=stages, world_size=8, assignment="contiguous")
        received, sent = Counter(), Counter()
        for rank, per_rank in enumerate(eight):
            r = per_rank["contiguous"][i]
            assert r["wrong"] == [], (what, rank, r["wrong"])
            received.update(r["received"])
            sent.update(r["sent"])
            if r["consumer"] is not None:
                expected = want[r["consumer"]] if r["consumer"] < len(want) else []
                assert r["ids"] == [meta.sample_ids[j] for j in expected], (what, rank)
        assert dict(received) == dict(sent) == plan.bytes_by_link, what


SMALL_PAIRS = [
    ("llama", L((0,)), L((1,)), "one rank to another"),
    ("llama", L(range(2), tp=2), L(range(2), dp=2), "tp2 -> dp2 in place"),
    ("tied", L(range(2), pp=2), L((1, 0), tp=2), "pp2 -> reversed tp2"),
]


def _refuse_then_work(rank: int, world_size: int) -> dict:
    """A plan naming ranks outside the world is refused on every rank before any traffic; the world still works."""
    cfg = tiny()
    bad = plan_reallocation(cfg, L(range(2), tp=2), L(range(2, 5), tp=3), bytes_per_element=4)  # world_size unknown here
    groups = ProcessGroups(groups_for(*(plan_reallocation(tiny(k), a, b, bytes_per_element=4)
                                        for k, a, b, _ in SMALL_PAIRS)))
    try:
        execute_reallocation(bad, shard_of(cfg, bad.src, rank, reference_state(cfg)) or None, groups, dtype=torch.float32)
        message = None
    except LayoutError as err:
        message = str(err)
    probe = torch.tensor([float(rank + 1)])
    dist.all_reduce(probe)  # a rank that had started sending would leave this collective mismatched
    return {"message": message, "sum": probe.item(), "pairs": _walk_pairs(rank, world_size, SMALL_PAIRS)}


def test_two_ranks_refuse_a_layout_outside_the_world_then_reallocate():
    results = spawn(_refuse_then_work, 2, timeout_seconds=300)
    for r in results:
        assert r["message"] is not None and "\n" not in r["message"]
        assert "uses ranks [2, 3, 4] but only 2 ranks exist" in r["message"]
        assert r["sum"] == 3.0
    _check(SMALL_PAIRS, [r["pairs"] for r in results], 2)
