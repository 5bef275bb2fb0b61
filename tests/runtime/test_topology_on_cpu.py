"""The runtime plans reallocations and data transfers with the run's node placement, as the estimator costs them."""

from __future__ import annotations

from types import SimpleNamespace

from realloc_cases import L, tiny

from restage.cluster import load_cluster
from restage.graph import DataflowGraph
from restage.plan.comm import links_seconds
from restage.plan.transfer_cost import exact_realloc
from restage.runtime.dataplane import comm_budget
from restage.runtime.dataplane.data_transfer import KeySpec
from restage.runtime.dataplane.routing import OutputMeta, SampleRouter
from restage.runtime.store.model_store import ModelStore
from restage.schedule.realloc_plan import plan_reallocation

# Two "nodes" of two ranks: ranks 0, 1 on node 0 and ranks 2, 3 on node 1.
CLUSTER = load_cluster("h100-80gb", nodes=2, devices_per_node=2)


def _schedule(per_node: int = 2):
    cfg = tiny()
    return SimpleNamespace(models={"actor": SimpleNamespace(arch=cfg, held_arch=cfg, dtype="fp32")},
                           cluster=SimpleNamespace(devices_per_node=per_node))


def _runtime_plan(src, dst):
    """The plan exactly as the worker makes it (``ModelStore.realloc_plan``), placement from the schedule."""
    schedule = _schedule()
    worker = SimpleNamespace(schedule=schedule, realloc_plans={},
                             cfg=SimpleNamespace(models={"actor": SimpleNamespace(dtype="fp32", init_critic_from_lm=False)}),
                             node_of=comm_budget.block_node_of(comm_budget.ranks_per_node(schedule)))
    return ModelStore.realloc_plan(worker, "actor", src, dst)


def _inter_node_bytes(bytes_by_link) -> int:
    return sum(n for (s, d), n in bytes_by_link.items() if CLUSTER.node_of(s) != CLUSTER.node_of(d))


def test_a_receiver_takes_every_piece_from_the_replica_on_its_own_node(monkeypatch):
    monkeypatch.delenv("RESTAGE_RANKS_PER_NODE", raising=False)
    src, dst = L((0, 2), dp=2), L((1,))  # replicas on node 0 (rank 0) and node 1 (rank 2); rank 1 receives
    plan = _runtime_plan(src, dst)
    assert {p.src_rank for p in plan.pieces} == {0}
    assert _inter_node_bytes(plan.bytes_by_link) == 0
    assert plan.total_bytes == plan.lower_bound_bytes > 0
    # Blind to nodes, load balancing would pull about half of it over the network from rank 2.
    blind = plan_reallocation(tiny(), src, dst, bytes_per_element=4)
    assert {p.src_rank for p in blind.pieces} == {0, 2} and _inter_node_bytes(blind.bytes_by_link) > 0


def test_the_runtime_plan_is_the_plan_the_estimator_costed(monkeypatch):
    monkeypatch.delenv("RESTAGE_RANKS_PER_NODE", raising=False)
    for src, dst in [(L((0, 2), dp=2), L((1,))), (L(range(4), dp=2, tp=2), L(range(4), dp=4)),
                     (L((0, 3), dp=2), L((1, 2), tp=2))]:
        runtime = _runtime_plan(src, dst)
        estimator = plan_reallocation(tiny(), src, dst, bytes_per_element=4, node_of=CLUSTER.node_of)
        assert runtime.pieces == estimator.pieces and runtime.bytes_by_link == estimator.bytes_by_link
        cost = exact_realloc(tiny(), src, dst, 4, CLUSTER)
        sends = [(p.src_rank, p.dst_ranks, p.numel * 4) for p in runtime.pieces]
        assert (runtime.total_bytes, links_seconds(CLUSTER, sends)) == (cost.total_bytes, cost.seconds)


def test_the_launchers_ranks_per_node_wins_over_the_schedules(monkeypatch):
    monkeypatch.setenv("RESTAGE_RANKS_PER_NODE", "4")
    node_of = comm_budget.block_node_of(comm_budget.ranks_per_node(_schedule(per_node=2)))
    assert [node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_data_transfer_is_sent_from_the_receivers_node():
    # One producer replica over ranks 1 (node 0) and 2 (node 1), both holding its outputs; rank 3 consumes.
    producer, consumer = L((1, 2), tp=2), L((3,))
    op = SimpleNamespace(src=producer, dst=consumer, key="values")
    meta = OutputMeta(ids=(10, 11, 12), seqlens=(5, 7, 3), group_size=1, keys=(KeySpec("values", True, "float32"),),
                      parts=((0, 1, 2),))
    flow = SampleRouter(DataflowGraph(()), {}, 3, comm_budget.block_node_of(2))
    plan = flow.plan(op, meta, "contiguous")
    assert [(m.src_rank, m.dst_ranks) for m in plan.messages] == [(2, (3,))]
    assert plan.bytes_by_link == {(2, 3): 15 * 4} and _inter_node_bytes(plan.bytes_by_link) == 0
    blind = SampleRouter(DataflowGraph(()), {}, 3).plan(op, meta, "contiguous")
    assert _inter_node_bytes(blind.bytes_by_link) == 15 * 4  # the lowest rank, on the other node
