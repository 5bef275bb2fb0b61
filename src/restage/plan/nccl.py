"""NCCL bus bandwidth of a group of ranks, by link (ring algorithms; what ``comm.py`` divides by).

Inside a node a ring runs over NVLink at the device's per-direction NVLink bandwidth times the
cluster's ``network_efficiency`` (NCCL's protocol overhead: on H100 NVLink 4, 450 GB/s line rate per
direction, NCCL reaches about 370 GB/s bus bandwidth with the ring algorithm: S. Jeaugey (NCCL),
NVIDIA/nccl-tests#212, 2024-05-06; 370 / 450 = 0.822).

A group that spans nodes runs at one NIC's figure (the inter-node bandwidth per device) times the same
efficiency. NCCL can run one ring channel per NIC, so a group with ``k`` ranks on every node could move
its inter-node traffic over ``k`` NICs at once (NVIDIA/nccl-tests#119: DGX-A100-class nodes with 4 HDR
NICs per 8 GPUs reach an all-reduce bus bandwidth of 96 GB/s of the 4 x 25 = 100 GB/s the NICs carry);
that is not modelled: the per-NIC figure is a lower bound for groups with several ranks per node.

Message size enters through the latency term of ``comm.py`` (``bytes / bus_bandwidth + hops x
latency``): a message reaches half the bus bandwidth at ``hops x latency x bus_bandwidth`` bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from restage.cluster import ClusterSpec


def bus_bandwidth(cluster: ClusterSpec, ranks: Sequence[int]) -> tuple[float, float]:
    """(bus bytes per second, latency seconds per hop) of a collective over ``ranks``."""
    return cluster.link(ranks)


def collective_bus_bandwidth(cluster: ClusterSpec, ranks: Sequence[int], nbytes: float) -> float:
    """Bus bytes per second an all-reduce of ``nbytes`` reaches over ``ranks`` (what nccl-tests reports as busbw):
    the ring's bandwidth term plus ``2 x ceil(log2 n)`` latencies, as ``comm.allreduce_seconds`` costs it."""
    n = len(ranks)
    bandwidth, latency = bus_bandwidth(cluster, ranks)
    seconds = 2 * (n - 1) / n * nbytes / bandwidth + 2 * max(1, math.ceil(math.log2(n))) * latency
    return 2 * (n - 1) / n * nbytes / seconds
