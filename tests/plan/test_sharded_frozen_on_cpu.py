"""A frozen model partitioned ZeRO-3 / FSDP style (``ModelRole.shard_frozen``): 1/dp of the parameters held. As the
peers run it (prefetching gathers): two gathered layers more while it runs, the all-gathers exposed beyond the
forward; as restage's runtime runs it (no prefetch): one gathered unit more, every gather exposed."""

import dataclasses

from plan_helpers import ideal_cluster

from restage.cluster import load_cluster
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.comm import allgather_seconds
from restage.plan.estimator import Estimator
from restage.plan.model_state import stage_param_elements
from restage.plan.roles import ModelRole

INF = MFC("ref_inf", "inference", "ref", ("seqs",), ("ref_logprobs",), 256, 128, 896)


def pair(cluster, strategy=Strategy(dp=16), m=4, prefetch=True):
    whole = ModelRole("ref", preset("llama-7b"), dtype="bf16")
    estimator = Estimator(cluster, use_profiles=False)
    layout = Layout.contiguous(0, strategy)
    return (estimator.estimate(INF, whole, layout, m),
            estimator.estimate(INF, dataclasses.replace(whole, shard_frozen=True, prefetch_gathers=prefetch), layout, m))


def test_sharded_frozen_model_holds_one_dp_share_and_two_gathered_layers():
    whole, sharded = pair(load_cluster("h100-80gb", nodes=2))
    params_bytes = sum(stage_param_elements(preset("llama-7b"), 1, 1)) * 2
    assert whole.state_bytes == params_bytes
    assert sharded.state_bytes == params_bytes // 16 and sharded.param_bytes == params_bytes // 16
    assert sharded.transient_bytes - whole.transient_bytes == int(2 * params_bytes / 32)


def test_gathers_cost_nothing_on_free_links_and_only_their_excess_over_the_forward_otherwise():
    whole, sharded = pair(ideal_cluster(nodes=2, devices_per_node=8))
    assert sharded.seconds == whole.seconds
    cluster = load_cluster("h100-80gb", nodes=2)
    whole, sharded = pair(cluster)
    params_bytes = sum(stage_param_elements(preset("llama-7b"), 1, 1)) * 2
    gather = allgather_seconds(cluster, tuple(range(16)), params_bytes)
    forward = whole.part("compute_seconds") / 4 + whole.part("tp_comm_seconds") / 4
    exposed = max(gather - forward, 0.0) + gather / 32
    assert sharded.part("zero3_gather_seconds") == 4 * exposed
    assert abs(sharded.seconds - whole.seconds - 4 * exposed) < 1e-9 * whole.seconds
    assert whole.part("zero3_gather_seconds") == 0.0


def test_restages_own_sharded_runtime_gathers_without_prefetch():
    cluster = load_cluster("h100-80gb", nodes=2)
    whole, sharded = pair(cluster, prefetch=False)
    params_bytes = sum(stage_param_elements(preset("llama-7b"), 1, 1)) * 2
    gather = allgather_seconds(cluster, tuple(range(16)), params_bytes)
    assert sharded.part("zero3_gather_seconds") == 4 * gather  # every micro-batch's forward gathers every layer
    assert abs(sharded.seconds - whole.seconds - 4 * gather) < 1e-9 * whole.seconds
    assert sharded.transient_bytes - whole.transient_bytes == int(params_bytes / 32)  # one unit gathered at a time
