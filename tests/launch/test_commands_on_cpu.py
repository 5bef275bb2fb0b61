import pytest

from restage.errors import LaunchError
from restage.launch.geometry import JobGeometry
from restage.launch.launcher import launch_command, rendezvous
from restage.launch.mpirun import mpirun_command
from restage.launch.rank import RankEnv, prepare, rank_env

PROGRAM = ["python", "-m", "restage.launch.rank", "restage.launch.selftest", "s.json"]


def test_mpirun_local_as_user_and_root():
    user = mpirun_command(4, PROGRAM, env={"A": "1", "B": "2"}, executable="mpirun", as_root=False)
    assert user == ["mpirun", "-n", "4", "--oversubscribe", "--map-by", "slot", "--bind-to", "none",
                    "-x", "A", "-x", "B", *PROGRAM]  # a local run oversubscribes the cores: nothing is bound
    root = mpirun_command(4, PROGRAM, executable="mpirun", as_root=True)
    assert root[:4] == ["mpirun", "-n", "4", "--allow-run-as-root"]


def test_mpirun_across_hosts_places_blocks():
    cmd = mpirun_command(6, PROGRAM, hosts=["a", "b"], ranks_per_node=3, executable="mpirun", as_root=False)
    assert cmd[cmd.index("--host") + 1] == "a:3,b:3"
    assert "--oversubscribe" not in cmd
    with pytest.raises(LaunchError, match="7 ranks do not fit on 2 host"):
        mpirun_command(7, PROGRAM, hosts=["a", "b"], ranks_per_node=3, executable="mpirun")


def test_srun_command():
    cmd = launch_command("srun", JobGeometry(16, 8, 8), None, PROGRAM, ["X"], ["--container-image=img"])
    assert cmd[:7] == ["srun", "--mpi=pmix", "--nodes=16", "--ntasks=128", "--ntasks-per-node=8",
                       "--kill-on-bad-exit=1", "--export=ALL"]
    assert cmd[7:] == ["--container-image=img", *PROGRAM]


def test_each_rank_gets_its_share_of_the_cores_on_both_paths(write_config):
    """srun does not inherit sbatch's --cpus-per-task (Slurm >= 22.05); mpirun bound nothing."""
    from restage.config.load import load_config
    from restage.launch.launcher import cpus_per_rank

    geometry = JobGeometry(2, 8, 8)
    srun = launch_command("srun", geometry, None, PROGRAM, cpus_per_rank=12)
    assert srun[5:7] == ["--cpus-per-task=12", "--cpu-bind=cores"]
    mpirun = launch_command("mpirun", geometry, ["a", "b"], PROGRAM, cpus_per_rank=12)
    at = mpirun.index("--map-by")
    assert mpirun[at:at + 4] == ["--map-by", "slot:PE=12", "--bind-to", "core"]
    cfg = load_config(write_config())
    assert cpus_per_rank(cfg, geometry, {"SLURM_CPUS_ON_NODE": "96"}) == 12  # the node's cores / its ranks
    assert cpus_per_rank(cfg, geometry, {}) is None  # outside SLURM nothing is bound
    assert cpus_per_rank(load_config(write_config(), ["slurm.cpus_per_task=6"]), geometry, {"SLURM_CPUS_ON_NODE": "96"}) == 6
    assert cpus_per_rank(cfg, geometry, {"SLURM_CPUS_ON_NODE": "96"}, usable_cpus=16) == 2  # fewer real cores
    assert cpus_per_rank(cfg, geometry, {"SLURM_CPUS_ON_NODE": "96"}, usable_cpus=4) is None  # oversubscribed


def test_the_driver_binds_and_sets_omp_threads(write_config, tmp_path, monkeypatch):
    """run_trial inside an allocation: the launch line binds cores and OMP_NUM_THREADS matches."""
    from restage.launch import job

    seen = {}

    class Fake:
        def __init__(self, command, env, log_path):
            seen.update(command=command, env=env)
            raise SystemExit(0)

    monkeypatch.setattr(job, "_Launched", Fake)
    monkeypatch.setattr(job.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "8")
    monkeypatch.setenv("RESTAGE_HOSTS", "n1")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/nccl/lib")
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("RESTAGE_NETWORK_INTERFACE", "eth7")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the user's own choice wins
    from restage.config.load import load_config

    cfg = load_config(write_config(), ["slurm.launcher=mpirun", "cluster.devices_per_node=2"])
    with pytest.raises(SystemExit):
        job.run_trial(cfg.to_dict(), str(tmp_path / "trial"))
    command, env = seen["command"], seen["env"]
    assert command[command.index("--map-by") + 1] == "slot:PE=4"  # 8 CPUs / 2 ranks per node
    assert env["OMP_NUM_THREADS"] == "4"
    forwarded = {command[i + 1] for i, arg in enumerate(command) if arg == "-x"}
    assert {"NCCL_IB_HCA", "LD_LIBRARY_PATH", "PYTHONPATH", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"} <= forwarded
    assert "CUDA_VISIBLE_DEVICES" not in forwarded  # each node keeps its own
    at = command.index("btl_tcp_if_include")
    assert command[at - 1:at + 5] == ["--mca", "btl_tcp_if_include", "eth7", "--mca", "oob_tcp_if_include", "eth7"]
    assert (env["NCCL_SOCKET_IFNAME"], env["GLOO_SOCKET_IFNAME"]) == ("eth7", "lo")
    assert env["OMPI_MCA_btl_tcp_if_include"] == "eth7"  # ranks srun starts read Open MPI's settings from here
    with pytest.raises(LaunchError, match="slurm.launcher: 'ssh' must be one of mpirun, srun"):
        launch_command("ssh", JobGeometry(1, 1, 0), None, PROGRAM)


def test_rendezvous_is_first_host():
    assert rendezvous(["n7", "n8"], "12345", env={}) == ("n7", 20000 + 12345 % 20000)
    assert rendezvous(["n7"], "1", env={"MASTER_ADDR": "x", "MASTER_PORT": "9"}) == ("x", 9)


def test_rank_env_from_open_mpi_and_srun():
    ompi = {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "OMPI_COMM_WORLD_NODE_RANK": "1",
            "SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_NODEID": "0"}  # the batch step's values, to be ignored
    assert rank_env(ompi) == RankEnv(rank=9, world_size=16, local_rank=1, local_world_size=8, node_rank=1)
    srun = {"SLURM_PROCID": "13", "SLURM_NTASKS": "16", "SLURM_LOCALID": "5", "SLURM_NODEID": "1",
            "RESTAGE_RANKS_PER_NODE": "8"}
    assert rank_env(srun) == RankEnv(rank=13, world_size=16, local_rank=5, local_world_size=8, node_rank=1)


def test_prepare_keeps_the_nodes_gpus_and_local_rank():
    """Every rank sees all of its node's GPUs (NCCL P2P/NVLink) and uses index LOCAL_RANK among them, which
    DeepSpeed's set_device(LOCAL_RANK) picks; under mpirun LOCAL_RANK == OMPI_COMM_WORLD_LOCAL_RANK."""
    env = {"OMPI_COMM_WORLD_RANK": "10", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "RESTAGE_RANKS_PER_NODE": "8", "RESTAGE_GPUS_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    prepare(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["NODE_RANK"]) == ("10", "16", "2", "1")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert env["LOCAL_RANK"] == env["OMPI_COMM_WORLD_LOCAL_RANK"] == env["RESTAGE_DEVICE_INDEX"]


def test_prepare_leaves_out_open_mpis_hierarchical_collectives_unless_the_user_chose():
    """coll/han's sub-communicators are built, busy-polling, inside the first collective on each communicator
    (76-177 s first transfers on the multinode cluster); a user's own OMPI_MCA_coll is kept."""
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    prepare(env)
    assert env["OMPI_MCA_coll"] == "^han"
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "OMPI_MCA_coll": "^hcoll"}
    prepare(env)
    assert env["OMPI_MCA_coll"] == "^hcoll"


def test_prepare_when_srun_bound_one_gpu_per_task():
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
           "RESTAGE_RANKS_PER_NODE": "4", "RESTAGE_GPUS_PER_NODE": "4", "CUDA_VISIBLE_DEVICES": "6"}
    prepare(env)
    assert (env["CUDA_VISIBLE_DEVICES"], env["LOCAL_RANK"], env["RESTAGE_DEVICE_INDEX"]) == ("6", "0", "0")
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "RESTAGE_RANKS_PER_NODE": "2", "RESTAGE_GPUS_PER_NODE": "2", "CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(LaunchError, match="local rank 1 sees one GPU \\(3\\) under mpirun"):
        prepare(ompi)


@pytest.mark.parametrize("visible", [None, "0,1,2,3,4,5,6,7", "4,5,6,7,0,1,2,3"])
@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
def test_every_local_rank_uses_its_own_gpu(visible, launcher):
    """For every local rank of a node: the visible devices and the LOCAL_RANK DeepSpeed (and
    runtime.control.channels's set_device(local_rank % device_count)) will use name the rank's own GPU, all distinct."""
    node_gpus = (visible or "0,1,2,3,4,5,6,7").split(",")
    used = []
    for local in range(8):
        rank = 8 + local  # node 1
        if launcher == "mpirun":
            env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "16",
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(local), "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}
        else:
            env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "16", "SLURM_LOCALID": str(local), "SLURM_NODEID": "1"}
        env.update(RESTAGE_RANKS_PER_NODE="8", RESTAGE_GPUS_PER_NODE="8")
        if visible:
            env["CUDA_VISIBLE_DEVICES"] = visible
        prepare(env)
        devices = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert devices == node_gpus  # the whole node, as SLURM gave it
        deepspeed_index = int(env["LOCAL_RANK"])
        assert deepspeed_index < len(devices)  # no "invalid device ordinal"
        assert deepspeed_index == local % len(devices)  # what runtime.control.channels.init_torch_distributed sets
        if launcher == "mpirun":
            assert env["LOCAL_RANK"] == env["OMPI_COMM_WORLD_LOCAL_RANK"]  # DeepSpeed's assertion
        used.append(devices[deepspeed_index])
    assert sorted(used) == sorted(node_gpus)  # each GPU exactly once


def test_program_module_override_and_clear_error(write_config, monkeypatch):
    from restage.config.load import load_config
    from restage.launch.launcher import program_module

    monkeypatch.delenv("RESTAGE_PROGRAM", raising=False)
    cfg = load_config(write_config())
    assert program_module(cfg) == "restage.launch.selftest"
    monkeypatch.setenv("RESTAGE_PROGRAM", "restage.launch.rank")  # the environment wins over the config
    assert program_module(cfg) == "restage.launch.rank"
    monkeypatch.setenv("RESTAGE_PROGRAM", "restage.no_such_program")
    with pytest.raises(LaunchError, match="program restage.no_such_program is not importable from "):
        program_module(cfg)


def test_shared_directory_check_names_the_nodes(tmp_path, monkeypatch):
    """The driver refuses, in one line, a trial directory some node does not see (the probe is faked here;
    tests/multinode runs it on a real three-node cluster)."""
    import subprocess

    from restage.launch import shared

    def fake_run(command, **kwargs):
        assert command[:6] == ["srun", "--mpi=none", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--overlap"]
        token = (tmp_path / f".shared-check-{__import__('os').getpid()}").read_text().strip()
        return subprocess.CompletedProcess(command, 0, stdout=f"n1 {token}\nn2 missing\n", stderr="")

    monkeypatch.setattr(shared.subprocess, "run", fake_run)
    with pytest.raises(LaunchError) as err:
        shared.check_shared_directory(tmp_path, ["n1", "n2", "n3"])
    assert "\n" not in str(err.value)
    assert f"the trial directory {tmp_path} is not shared by every node: n2, n3 " in str(err.value)
    assert "set run.results_dir" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # the token file is removed
