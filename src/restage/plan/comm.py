"""Seconds of collectives and point-to-point traffic over a cluster's links (ring algorithms).

Bandwidths are NCCL bus bandwidths (``nccl.py``): a group inside a node runs at the NVLink figure,
one that spans nodes at one NIC's figure times the group's ranks per node (one ring channel per NIC).
Sizes are the full buffer in bytes, as the caller sees it. Latency grows with log2 of the group
size (NCCL's tree and low-latency protocols), bandwidth terms are those of a ring.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence

from restage.cluster import ClusterSpec
from restage.plan.nccl import bus_bandwidth


def _hops(n: int) -> int:
    return max(1, math.ceil(math.log2(n)))


def allreduce_seconds(cluster: ClusterSpec, ranks: Sequence[int], nbytes: float) -> float:
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = bus_bandwidth(cluster, ranks)
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * _hops(n) * latency


def allgather_seconds(cluster: ClusterSpec, ranks: Sequence[int], nbytes: float) -> float:
    """Gather a buffer of ``nbytes`` (in total) that starts split evenly over ``ranks``."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = bus_bandwidth(cluster, ranks)
    return (n - 1) / n * nbytes / bandwidth + _hops(n) * latency


reduce_scatter_seconds = allgather_seconds  # the same traffic in the other direction


# An all-to-all in which every rank holds ``nbytes`` split evenly over the group: each rank sends and receives
# (n - 1) / n of it, the same traffic per rank as an all-gather of an ``nbytes`` buffer.
alltoall_seconds = allgather_seconds


def broadcast_seconds(cluster: ClusterSpec, ranks: Sequence[int], nbytes: float) -> float:
    """One rank's buffer of ``nbytes`` to the others (pipelined, so the bytes cross each link once)."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = bus_bandwidth(cluster, ranks)
    return nbytes / bandwidth + _hops(n) * latency


def p2p_seconds(cluster: ClusterSpec, src: int, dst: int, nbytes: float) -> float:
    if src == dst or nbytes <= 0:
        return 0.0
    bandwidth, latency = cluster.link((src, dst))
    return nbytes / bandwidth + latency


def links_seconds(cluster: ClusterSpec, sends: Iterable[tuple[int, Iterable[int], float]]) -> float:
    """Seconds until every rank has sent and received its part of ``sends``.

    Each item is (sender, receivers, bytes): one buffer the sender broadcasts to its receivers.
    A pipelined broadcast costs each receiver the bytes once and the sender the bytes once per
    receiving node. Ranks send and receive at the same time. Buffers between the same two ranks
    travel as one message (the runtime buckets them), so latency is paid once per peer.
    """
    send_seconds: dict[int, float] = defaultdict(float)
    recv_seconds: dict[int, float] = defaultdict(float)
    peers: dict[int, set[int | tuple[str, int]]] = defaultdict(set)  # a receiver's senders; a sender's ("node", n)
    for src, receivers, nbytes in sends:
        if nbytes <= 0:
            continue
        nodes_done = set()
        for dst in receivers:
            if dst == src:
                continue
            bandwidth, latency = cluster.link((src, dst))
            recv_seconds[dst] += nbytes / bandwidth
            if src not in peers[dst]:
                peers[dst].add(src)
                recv_seconds[dst] += latency
            node = cluster.node_of(dst)
            if node not in nodes_done:
                nodes_done.add(node)
                send_seconds[src] += nbytes / bandwidth
                if ("node", node) not in peers[src]:
                    peers[src].add(("node", node))
                    send_seconds[src] += latency
    ranks = set(send_seconds) | set(recv_seconds)
    return max((max(send_seconds[r], recv_seconds[r]) for r in ranks), default=0.0)
