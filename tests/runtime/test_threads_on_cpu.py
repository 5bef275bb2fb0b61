"""The per-rank thread rule (runtime/control/threads.py): the cores a rank may use, shared with the ranks beside it."""

import os

import pytest
import torch

from restage.config.load import load_config
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule
from restage.runtime.control.threads import (
    ThreadChoice,
    _cpu_list_size,
    apply_threads,
    cgroup_cpus,
    idle_local_ranks,
    local_ranks,
    threads_for,
)
from restage.runtime.dataplane.comm_budget import ranks_per_node
from restage.runtime.spmd import ranks_with_work

NODE = set(range(16))  # a 16-core node


def count(affinity, local_size, local_rank, env=None, configured=0, node_cpus=None, idle=()):
    return threads_for(affinity, local_size, local_rank, env or {}, configured, node_cpus, idle).count


def test_ranks_bound_apart_use_their_own_cores():
    # srun --cpu-bind=cores / mpirun --bind-to core: 4 ranks, 4 cores each, the node's 16 in the cgroup
    assert [count({4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3}, 4, r, node_cpus=16) for r in range(4)] == [4, 4, 4, 4]
    assert count({0}, 8, 3, node_cpus=16) == 1  # one core each
    assert count(set(range(8)), 8, 5, node_cpus=16) == 2  # bound to a socket of 8 cores, 4 ranks per socket


def test_ranks_sharing_one_mask_split_it():
    assert [count(NODE, 4, r, node_cpus=16) for r in range(4)] == [4, 4, 4, 4]
    assert [count(NODE, 4, r) for r in range(4)] == [4, 4, 4, 4]  # cgroup unknown: shared by every local rank
    assert [count(set(range(7)), 2, r, node_cpus=7) for r in range(2)] == [4, 3]  # the first takes the odd core
    # a SLURM cgroup of 8 CPUs on a 64-core node, tasks not bound: the mask is the cgroup, shared by both
    assert [count(set(range(8)), 2, r, node_cpus=8) for r in range(2)] == [4, 4]


def test_more_ranks_than_cores_get_one_thread_each():
    assert [count({0, 1}, 4, r, node_cpus=2) for r in range(4)] == [1, 1, 1, 1]
    assert count({0, 1}, 3, 2) == 1


def test_omp_num_threads_and_the_config_key_override_in_that_order():
    assert threads_for(NODE, 4, 0, {"OMP_NUM_THREADS": "1"}, 0, 16) == ThreadChoice(1, "OMP_NUM_THREADS=1")
    assert count(NODE, 4, 0, {"OMP_NUM_THREADS": "6"}) == 6  # a user's value is taken as it is
    assert count(NODE, 4, 0, {"OMP_NUM_THREADS": ""}, node_cpus=16) == 4  # empty: not set
    assert count(NODE, 4, 0, {"OMP_NUM_THREADS": "0"}, node_cpus=16) == 4  # not a count
    chosen = threads_for(NODE, 4, 0, {"OMP_NUM_THREADS": "1", "SLURM_CPUS_PER_TASK": "2"}, 3, 16)
    assert chosen == ThreadChoice(3, "run.threads_per_rank=3")


def test_slurm_cpus_per_task_is_the_tasks_share_within_its_mask():
    assert count(NODE, 4, 1, {"SLURM_CPUS_PER_TASK": "3"}, node_cpus=16) == 3  # unbound tasks: SLURM's share
    assert count({0, 1, 2}, 4, 1, {"SLURM_CPUS_PER_TASK": "3"}, node_cpus=16) == 3  # bound: the same
    assert count({0, 1}, 4, 1, {"SLURM_CPUS_PER_TASK": "3"}, node_cpus=16) == 2  # never more than its mask
    assert count(NODE, 4, 1, {"SLURM_CPUS_PER_TASK": "3", "OMP_NUM_THREADS": "5"}) == 5


def test_local_ranks_from_each_launchers_variables():
    assert local_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
                        "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1"}) == (4, 3)  # mpirun inside sbatch
    assert local_ranks({"LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "2"}) == (8, 2)
    assert local_ranks({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"}) == (2, 1)
    slurm = {"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2(x3),1"}
    assert local_ranks({**slurm, "SLURM_NODEID": "2"}) == (2, 0)
    assert local_ranks({**slurm, "SLURM_NODEID": "3"}) == (1, 0)
    assert local_ranks({}) == (1, 0)


def test_cgroup_cpus_reads_v2_then_v1(tmp_path):
    assert _cpu_list_size("0-3,8,10-11\n") == 7
    v2 = tmp_path / "v2"
    (v2 / "job" / "step").mkdir(parents=True)
    (v2 / "job" / "step" / "cpuset.cpus.effective").write_text("2-5\n")
    (tmp_path / "cg2").write_text("0::/job/step\n")
    assert cgroup_cpus(tmp_path / "cg2", v2) == 4
    v1 = tmp_path / "v1"
    (v1 / "cpuset" / "slurm").mkdir(parents=True)
    (v1 / "cpuset" / "slurm" / "cpuset.effective_cpus").write_text("0-1,4-5\n")
    (tmp_path / "cg1").write_text("3:cpuset:/slurm\n2:memory:/x\n0::/\n")
    assert cgroup_cpus(tmp_path / "cg1", v1) == 4
    assert cgroup_cpus(tmp_path / "missing", v1) is None


def test_apply_sets_torch_and_the_environment(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        apply_threads(ThreadChoice(2, "test"))
        assert torch.get_num_threads() == 2
        assert os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)



def test_ranks_without_ops_leave_their_share_to_the_ranks_with_ops():
    # restage run -n 2 of GRPO tiny on a 2-core machine: every MFC on rank 0, rank 1 only waits for control messages
    assert [count({0, 1}, 2, r, node_cpus=2, idle={1}) for r in range(2)] == [2, 1]
    assert [count(NODE, 4, r, node_cpus=16, idle={1, 3}) for r in range(4)] == [8, 1, 8, 1]
    assert [count(set(range(7)), 3, r, node_cpus=7, idle={0}) for r in range(3)] == [1, 4, 3]  # odd core: first busy
    assert [count(NODE, 4, r, idle={2}) for r in range(4)] == [6, 5, 1, 5]  # cgroup unknown: the mask is shared
    chosen = threads_for({0, 1}, 2, 1, {}, 0, 2, idle_local_ranks={1})
    assert chosen == ThreadChoice(1, "no op of the schedule on it: the 2 cores of its CPU mask go to the 1 of the "
                                     "node's 2 rank(s) that have some")
    # Ranks bound apart keep their own cores, idle or not; a node with no busy rank splits as before.
    assert [count({4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3}, 4, r, node_cpus=16, idle={1}) for r in range(4)] == [4] * 4
    assert [count({0, 1}, 2, r, node_cpus=2, idle={0, 1}) for r in range(2)] == [1, 1]
    # The user's count and OMP_NUM_THREADS still come first.
    assert count({0, 1}, 2, 1, {"OMP_NUM_THREADS": "2"}, node_cpus=2, idle={1}) == 2
    assert count({0, 1}, 2, 0, configured=1, node_cpus=2, idle={1}) == 1


def test_idle_local_ranks_are_the_nodes_ranks_without_ops():
    assert idle_local_ranks({0}, rank=1, ranks_per_node=2, world_size=2) == {1}
    assert idle_local_ranks({0, 1}, rank=0, ranks_per_node=2, world_size=2) == frozenset()
    # two nodes of 4 (block placement): node 1 holds ranks 4-7, of which 4 and 6 have ops
    assert idle_local_ranks({0, 1, 2, 3, 4, 6}, rank=6, ranks_per_node=4, world_size=8) == {1, 3}
    assert idle_local_ranks({0, 1, 2, 3, 4, 6}, rank=2, ranks_per_node=4, world_size=8) == frozenset()
    assert idle_local_ranks({0}, rank=4, ranks_per_node=4, world_size=6) == {0, 1}  # a last node with 2 ranks


@pytest.mark.parametrize("layout, busy, threads", [("ranks:0 dp1", {0}, [2, 1]), ("ranks:0-1 dp2", {0, 1}, [1, 1])])
def test_a_grpo_plan_on_two_ranks_sets_the_threads_of_the_ranks_it_uses(layout, busy, threads):
    cfg = load_config("jobs/grpo_tiny.yaml", ["plan.mode=manual", "cluster.nodes=1", "cluster.devices_per_node=2",
                                               "run.nprocs=2", *[f"plan.layouts.{mfc}={layout}"
                                                                 for mfc in ("actor_gen", "ref_inf", "actor_train")]])
    schedule = build_schedule(cfg, make_plan(cfg, with_baselines=False))
    assert ranks_with_work(schedule) == busy
    idle = [idle_local_ranks(busy, rank, ranks_per_node(schedule), schedule.world_size) for rank in range(2)]
    assert [threads_for({0, 1}, 2, rank, {}, 0, 2, idle[rank]).count for rank in range(2)] == threads
