import pytest

from restage.errors import LaunchError
from restage.launch.geometry import JobGeometry
from restage.launch.job import launch_command, rendezvous
from restage.launch.mpirun import mpirun_command
from restage.launch.rank import RankEnv, prepare, rank_env

PROGRAM = ["python", "-m", "restage.launch.rank", "restage.launch.selftest", "s.json"]


def test_mpirun_local_as_user_and_root():
    user = mpirun_command(4, PROGRAM, env={"A": "1", "B": "2"}, executable="mpirun", as_root=False)
    assert user == ["mpirun", "-n", "4", "--oversubscribe", "--map-by", "slot", "--bind-to", "none",
                    "-x", "A", "-x", "B", *PROGRAM]
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


def test_prepare_binds_one_gpu():
    env = {"OMPI_COMM_WORLD_RANK": "10", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "RESTAGE_RANKS_PER_NODE": "8", "RESTAGE_GPUS_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    prepare(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["NODE_RANK"]) == ("10", "16", "2", "1")
    assert env["CUDA_VISIBLE_DEVICES"] == "2"


def test_program_module_override_and_clear_error(write_config, monkeypatch):
    from restage.config import load_config
    from restage.launch.job import program_module

    monkeypatch.delenv("RESTAGE_PROGRAM", raising=False)
    cfg = load_config(write_config())
    assert program_module(cfg) == "restage.launch.selftest"
    monkeypatch.setenv("RESTAGE_PROGRAM", "restage.launch.rank")  # the environment wins over the config
    assert program_module(cfg) == "restage.launch.rank"
    monkeypatch.setenv("RESTAGE_PROGRAM", "restage.no_such_program")
    with pytest.raises(LaunchError, match="program restage.no_such_program is not importable from "):
        program_module(cfg)
