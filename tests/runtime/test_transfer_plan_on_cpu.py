"""The data-transfer planner: balance, exactly-once delivery, senders, bytes, refusals."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from realloc_cases import L
from transfer_cases import TRANSFERS_8, make_meta

from restage.errors import LayoutError
from restage.models.packing import contiguous_parts
from restage.runtime.dataplane.data_transfer import balance_by_tokens, plan_transfer


def test_balance_stays_within_one_sample_of_tokens():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.choice([1, 2, 5, 30, 200]) * rng.randint(1, 9) for _ in range(rng.randint(1, 40))]
        parts = balance_by_tokens(tokens, rng.randint(1, 9))
        assert sorted(i for p in parts for i in p) == list(range(len(tokens)))
        loads = [sum(tokens[i] for i in p) for p in parts]
        assert max(loads) - min(loads) <= max(tokens)
        assert all(p == sorted(p) for p in parts)


@pytest.mark.parametrize("producer,consumer,stages,n,group,what", TRANSFERS_8, ids=[c[-1] for c in TRANSFERS_8])
def test_every_receiver_gets_each_of_its_samples_once(producer, consumer, stages, n, group, what):
    meta = make_meta(1, n, producer.strategy.dp, group)
    plan = plan_transfer(meta, producer, consumer, consumer_stages=stages, node_of=lambda r: r // 3, world_size=8)
    assert sorted(i for p in plan.assignment for i in p) == list(range(n))
    tokens = plan.tokens_by_consumer()
    assert max(tokens) - min(tokens) <= max(meta.sample_tokens(i) for i in range(n))
    _check_delivery(plan, meta, consumer, stages)


def _check_delivery(plan, meta, consumer, stages):
    """Each receiver gets each of its consumer DP rank's samples exactly once (or holds it), from a holder; bytes add up."""
    owner = {i: d for d, part in enumerate(meta.producer_parts) for i in part}
    delivered = Counter((i, r) for m in plan.messages for i in m.samples for r in m.dst_ranks)
    expected_bytes = 0
    for d, part in enumerate(plan.assignment):
        for i in part:
            for r in plan.receivers[d]:
                held = r in plan.holders[owner[i]]
                assert delivered[(i, r)] == (0 if held else 1), (i, r)
                expected_bytes += 0 if held else meta.sample_bytes(i)
    assert plan.total_bytes == expected_bytes == sum(m.nbytes * len(m.dst_ranks) for m in plan.messages)
    for m in plan.messages:
        assert all(m.src_rank in plan.holders[owner[i]] for i in m.samples)
        assert m.src_rank not in m.dst_ranks
    s = consumer.strategy
    wanted = range(s.pp) if stages is None else stages
    assert {r for rs in plan.receivers for r in rs} == {consumer.rank_at(p, d, t) for p in wanted
                                                        for d in range(s.dp) for t in range(s.tp)}


def test_a_sender_inside_the_consumer_replica_is_preferred():
    meta = make_meta(2, 12, 2)
    # Producer replicas (0, 1), (2, 3); consumer replicas (1, 2), (3, 4): three pairs share a rank.
    plan = plan_transfer(meta, L(range(4), dp=2, tp=2), L(range(1, 5), dp=2, tp=2))
    owner = {i: d for d, part in enumerate(meta.producer_parts) for i in part}
    shared_senders = 0
    for m in plan.messages:
        consumer = next(d for d, part in enumerate(plan.assignment) if m.samples[0] in part)
        shared = set(plan.holders[owner[m.samples[0]]]) & set(plan.receivers[consumer])
        if shared:
            assert m.src_rank in shared and len(m.dst_ranks) == 1
            shared_senders += 1
        else:
            assert len(m.dst_ranks) == 2
    assert shared_senders >= 2


def test_mismatched_metadata_and_outside_ranks_are_refused_in_one_line():
    meta = make_meta(3, 4, 2)
    with pytest.raises(LayoutError, match="names 2 producer DP ranks but .* has dp=4"):
        plan_transfer(meta, L(range(4), dp=4), L(range(2), dp=2))
    with pytest.raises(LayoutError) as err:
        plan_transfer(meta, L(range(2), dp=2), L(range(6, 10), dp=4), world_size=8)
    assert "uses ranks [8, 9] but only 8 ranks exist" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("producer,consumer,stages,n,group,what", TRANSFERS_8, ids=[c[-1] for c in TRANSFERS_8])
def test_contiguous_assignment_cuts_the_global_order_as_the_runtime_does(producer, consumer, stages, n, group, what):
    meta = make_meta(4, n, producer.strategy.dp, group)
    node_of = lambda r: r // 3  # noqa: E731
    plan = plan_transfer(meta, producer, consumer, consumer_stages=stages, node_of=node_of, world_size=8,
                         assignment="contiguous")
    want = contiguous_parts([meta.sample_tokens(i) for i in range(n)], consumer.strategy.dp)
    assert [list(part) for part in plan.assignment] == want + [[]] * (consumer.strategy.dp - len(want))
    _check_delivery(plan, meta, consumer, stages)


def test_an_explicit_assignment_is_followed_and_a_wrong_one_refused():
    meta = make_meta(5, 6, 2)
    plan = plan_transfer(meta, L(range(2), dp=2), L(range(2, 5), dp=3), assignment=[[5, 0], [], [1, 2, 3, 4]])
    assert plan.assignment == ((0, 5), (), (1, 2, 3, 4))
    _check_delivery(plan, meta, L(range(2, 5), dp=3), None)
    for wrong in ([[0, 1], [2, 3], [4]], [[0, 1, 2], [3, 4, 5]], [[0, 1], [1, 2, 3], [4, 5]]):
        with pytest.raises(LayoutError, match="each of the 6 samples to exactly one of the consumer's 3 DP ranks"):
            plan_transfer(meta, L(range(2), dp=2), L(range(2, 5), dp=3), assignment=wrong)
    with pytest.raises(LayoutError, match="unknown assignment 'balanced'"):
        plan_transfer(meta, L(range(2), dp=2), L(range(2, 5), dp=3), assignment="balanced")
