import pytest

from restage.cluster import ClusterSpec, load_cluster
from restage.errors import ConfigError


@pytest.mark.parametrize("name", ["local-cpu", "a100-80gb", "h100-80gb", "h200-141gb"])
def test_every_shipped_cluster_loads_with_any_node_count(name):
    one = load_cluster(name)
    many = load_cluster(name, nodes=5)
    assert many.nodes == 5 and many.world_size == 5 * one.devices_per_node
    assert ClusterSpec.from_json(many.to_json()) == many
    for dtype in ("fp32", "bf16", "fp16"):
        assert many.peak_flops_per_second(dtype) > 0
    assert 0 < many.usable_memory_bytes < many.memory_bytes


def test_vendor_figures_of_the_gpu_clusters():
    a100, h100 = load_cluster("a100-80gb"), load_cluster("h100-80gb")
    assert a100.peak_bf16_flops_per_second == pytest.approx(312e12)
    assert h100.peak_bf16_flops_per_second == pytest.approx(989e12)
    assert a100.memory_bandwidth_bytes_per_second == pytest.approx(2.039e12)
    assert h100.memory_bandwidth_bytes_per_second == pytest.approx(3.35e12)
    assert a100.memory_bytes == h100.memory_bytes == 80 * 2**30
    # NVLink per direction is an order of magnitude above the per-GPU InfiniBand NIC.
    for c in (a100, h100):
        assert c.intra_node_bandwidth_bytes_per_second > 5 * c.inter_node_bandwidth_bytes_per_second


def test_nodes_follow_devices_per_node_not_a_constant():
    c = load_cluster("h100-80gb", nodes=3, devices_per_node=4)
    assert [c.node_of(r) for r in (0, 3, 4, 11)] == [0, 0, 1, 2]
    intra_bw, _ = c.link((0, 3))
    inter_bw, inter_latency = c.link((3, 4))
    assert intra_bw == pytest.approx(c.intra_node_bandwidth_bytes_per_second * c.network_efficiency)
    assert inter_bw == pytest.approx(c.inter_node_bandwidth_bytes_per_second * c.network_efficiency)
    assert inter_latency == c.inter_node_latency_seconds


def test_unknown_cluster_and_bad_file_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown; use one of .*h100-80gb"):
        load_cluster("dgx-z9000")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nnodes: 1\n")
    with pytest.raises(ConfigError, match="missing keys"):
        load_cluster(str(bad))
