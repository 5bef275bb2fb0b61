"""Helpers shared by the plan tests: configs from presets, a stub estimator, an ideal-network cluster.

(A module of its own, not conftest: several test directories have a conftest, and importing
``conftest`` by name picks whichever was loaded first.)
"""

from __future__ import annotations

import dataclasses

from restage.cluster import load_cluster
from restage.config.load import config_from_dict
from restage.plan.estimator import Estimate


def ppo_config(actor="llama-7b", critic="llama-7b", nodes=1, cluster="h100-80gb", batch=512, prompt=128, gen=896,
               zero=1, **extra):
    def model(arch, trainable):
        return {"arch": arch, "trainable": trainable, "dtype": "bf16", "zero_stage": zero}

    return config_from_dict({"experiment": "t", "algorithm": "ppo",
                             "models": {"actor": model(actor, True), "critic": model(critic, True),
                                        "ref": model(actor, False), "reward": model(critic, False)},
                             "run": {"batch_size": batch}, "dataset": {"max_prompt_tokens": prompt},
                             "generation": {"max_new_tokens": gen}, "algo": {"minibatches": 4},
                             "cluster": {"name": cluster, "nodes": nodes}, **extra})


def ideal_cluster(nodes=1, devices_per_node=4):
    """A cluster whose links are (practically) free, so simulated times are sums of MFC times."""
    base = load_cluster("h100-80gb")
    return dataclasses.replace(base, nodes=nodes, devices_per_node=devices_per_node,
                               intra_node_bandwidth_bytes_per_second=1e30, inter_node_bandwidth_bytes_per_second=1e30,
                               intra_node_latency_seconds=0.0, inter_node_latency_seconds=0.0,
                               host_bandwidth_bytes_per_second=1e30)


class StubEstimator:
    """Fixed seconds per MFC name (divided by the mesh size when ``scale``), tiny memory."""

    def __init__(self, seconds: dict[str, float], scale: bool = False, transient_bytes: int = 0, state_bytes: int = 0):
        self.seconds, self.scale = seconds, scale
        self.transient_bytes, self.state_bytes = transient_bytes, state_bytes

    def estimate(self, mfc, role, layout, micro_batches=None):
        seconds = self.seconds[mfc.name] / (layout.size if self.scale else 1)
        return Estimate(seconds=seconds, state_bytes=self.state_bytes, param_bytes=self.state_bytes,
                        transient_bytes=self.transient_bytes, micro_batches=micro_batches or 1, source="stub")
