import pytest

from restage.config.load import load_config
from restage.errors import ConfigError, LaunchError
from restage.launch.geometry import JobGeometry, device_binding, job_geometry, placement, placements, visible_device


def test_block_placement_16_nodes_8_gpus():
    geometry = JobGeometry(nodes=16, ranks_per_node=8, gpus_per_node=8)
    assert geometry.world_size == 128
    table = placements(geometry)
    assert [(p.node, p.local_rank, p.device) for p in table[:9]] == [(0, i, i) for i in range(8)] + [(1, 0, 0)]
    last = placement(127, geometry)
    assert (last.node, last.local_rank, last.device) == (15, 7, 7)
    # every (node, device) pair is used exactly once
    assert len({(p.node, p.device) for p in table}) == 128
    with pytest.raises(ValueError):
        placement(128, geometry)


def test_cpu_ranks_have_no_device():
    table = placements(JobGeometry(nodes=2, ranks_per_node=3, gpus_per_node=0))
    assert [(p.node, p.local_rank, p.device) for p in table] == [(0, 0, None), (0, 1, None), (0, 2, None),
                                                                (1, 0, None), (1, 1, None), (1, 2, None)]


def test_one_rank_per_gpu_is_enforced():
    with pytest.raises(ConfigError, match="one rank per GPU"):
        JobGeometry(nodes=1, ranks_per_node=4, gpus_per_node=8)


def test_geometry_from_config_and_cluster_file(write_config):
    gpu = load_config(write_config(), ["cluster.name=h100-80gb", "cluster.nodes=16", "cluster.devices_per_node=0"])
    assert job_geometry(gpu) == JobGeometry(16, 8, 8)
    cpu = load_config(write_config(), ["cluster.devices_per_node=0"])  # local-cpu.yaml: 2 CPU "devices"
    assert job_geometry(cpu) == JobGeometry(1, 2, 0)
    with pytest.raises(ConfigError, match=r"run.nprocs=5 but the cluster gives 1 node\(s\) x 3 devices = 3 ranks"):
        job_geometry(load_config(write_config(), ["run.nprocs=5"]))


@pytest.mark.parametrize("local_rank,gpus,visible,expected,index", [
    (3, 8, None, "0,1,2,3,4,5,6,7", 3),  # nothing inherited: all of the node's GPUs, index = local rank
    (1, 4, "4,5,6,7", "4,5,6,7", 1),     # SLURM gave this job GPUs 4-7 of the node: kept, the rank's is "5"
    (2, 4, "6", "6", 0),                 # srun already bound the task to one GPU: device index 0
    (0, 0, "0,1", None, None),           # CPU ranks: leave the variable alone
])
def test_visible_device(local_rank, gpus, visible, expected, index):
    assert visible_device(local_rank, gpus, visible) == expected
    binding = device_binding(local_rank, gpus, visible)
    assert (binding.index if binding else None) == index
    if binding:
        assert binding.gpu == {None: str(local_rank), "4,5,6,7": "5", "6": "6"}[visible]


def test_visible_device_too_few():
    with pytest.raises(LaunchError, match="local rank 2 has no GPU"):
        visible_device(2, 2, "0,1")


def dry_run_ranks(script: str) -> int:
    import re

    return int(re.search(r"RESTAGE_WORLD_SIZE=(\d+)", script).group(1))


@pytest.mark.parametrize("job", ["jobs/ppo_tiny.yaml", "jobs/gpu_ppo_300m.yaml"])
def test_submit_on_two_gpu_nodes_derives_run_nprocs(job, capsys, monkeypatch):
    """A shipped job submitted to 2 nodes of 8 H100s, run.nprocs not given: 16 ranks, nothing to add."""
    import contextlib
    from pathlib import Path

    from restage import cli

    # The geometry alone: with the runtime as the program, submit also checks the models and plans
    # (tests/launch/test_submit_checks_on_cpu.py), and gpu_ppo_300m's model directory is built only for GPU checks.
    monkeypatch.setenv("RESTAGE_PROGRAM", "restage.launch.selftest")
    with contextlib.chdir(Path(__file__).resolve().parents[2]):
        code = cli.main(["submit", job, "--dry-run", "cluster.name=h100-80gb", "cluster.nodes=2",
                         "cluster.devices_per_node=0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert dry_run_ranks(out) == 16 and "mpirun -n 16 " in out and "--host <host0>:8,<host1>:8" in out


def test_a_run_nprocs_the_user_set_must_agree(write_config, capsys):
    from restage import cli

    gpu = ["cluster.name=h100-80gb", "cluster.nodes=2", "cluster.devices_per_node=0"]
    assert job_geometry(load_config(write_config(), gpu)).world_size == 16
    assert job_geometry(load_config(write_config(), [*gpu, "run.nprocs=16"])).world_size == 16
    for wrong in (1, 8):  # 1 used to pass as "not set"
        path = write_config(f"wrong{wrong}.yaml", run={"steps": 4, "nprocs": wrong})
        assert cli.main(["submit", str(path), "--dry-run", *gpu]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"restage: error: run.nprocs={wrong} but the cluster gives 2 node(s) x 8 devices = 16 ranks; leave "
            "run.nprocs out (it is derived from the cluster) or set run.nprocs=16"]
