"""The scale matrix over two nodes: cases of tests/scale's matrix (the same layouts and ZeRO stage) submitted with
``restage submit`` to the multinode cluster's scale partition, 8 ranks as 2 nodes x 4 and 16 as 2 nodes x 8, each
equal to the one-rank run of the same job after 2 steps (tests/scale/scale_jobs.py: the job, the tolerance and why
it is exact).

Ranks are placed in blocks (rank r on node r // ranks-per-node), so a pipeline of 2 or 4 stages puts half its
stages on each node, a dp8 or dp4 x tp4 group spans both, and tp stays inside a node. The scale partition's nodes
(rmn4, rmn5) each declare 8 CPUs and 8 stub GPUs on this machine's two cores (scripts/slurm_multinode.sh), so the
ranks share the cores unbound. ``make test-scale`` runs them (marker ``scale``); ``RESTAGE_SCALE_REPORT=FILE``
appends each case's figures to FILE (nodes 2); the wall time from submission is printed (pytest -s). The issue's
mixed plan runs in ``make test`` too (``CORE``).
"""

from __future__ import annotations

import dataclasses
import sys
import time

import pytest
from multinode_jobs import REPO, failure_report, placement, rank_facts, submit_job, wait_finished

sys.path.insert(0, str(REPO / "tests" / "scale"))
import test_layout_matrix_scale as matrix  # noqa: E402  (the matrix's cases and feasibility rule, not its tests)
from scale_jobs import MODELS, Case, difference, job_args, record, reference, scale_assets  # noqa: E402

from restage.launch.trial import read_json  # noqa: E402

pytestmark = pytest.mark.multinode
NODES = 2
PARTITION = "multinode-scale"  # rmn4, rmn5: 8 CPUs and 8 stub GPUs each
# The one-rank run's precision: on this cluster's stub GPUs `dtype: auto` would be bf16 (config._resolve_auto_dtypes),
# whose rounding moves the weights by ~2e-2 after 2 steps, a thousand times the matrix's tolerance.
FP32 = tuple(f"models.{m}.dtype=fp32" for m in MODELS)
# The matrix's cases run again over two nodes: the mixed plan (dp2 x tp2 x pp2 training, pp across the
# nodes), dp8 ZeRO-3 (the gradient reduce-scatter and parameter gathers across nodes), tp2 x pp4 (two stages per
# node), and at 16 ranks dp2 x tp2 x pp4 training beside dp8 x tp2 generation and dp4 x tp4 ZeRO-3.
ON_TWO_NODES = ("issue-mixed-3d", "dp-dp8-zero3", "tp_pp-dp1tp2pp4-zero2", "16-dp2tp2pp4-gen-dp8tp2",
                "16-dp4tp4-zero3")
# Every case is in make test-scale only (make test's time bound; the plan on one node stays in make test:
# tests/scale's CORE). The plan took 77 s here, 102 s from submission at load average 28.
CORE: set[str] = set()


def two_node_case(name: str) -> Case:
    case = {c.name: c for c in matrix.CASES}[name]
    return dataclasses.replace(case, name=f"2nodes-{name}", nodes=NODES)


@pytest.fixture(scope="session")
def scale_assets_dir(tmp_path_factory):
    """(dense model, mixture model, fixed-length prompts) on the file system every node shares."""
    return scale_assets(tmp_path_factory.mktemp("scale-assets"))


@pytest.fixture(scope="session")
def scale_results(tmp_path_factory):
    return tmp_path_factory.mktemp("scale-multinode")


@pytest.mark.parametrize("case", [pytest.param(two_node_case(n), id=n, marks=[] if n in CORE else [pytest.mark.scale])
                                  for n in ON_TWO_NODES])
def test_layout_over_two_nodes_equals_one_rank_run(case: Case, scale_results, scale_assets_dir):
    refused = matrix._feasible(case, scale_assets_dir)
    if refused:
        pytest.skip(f"the feasibility rule refuses it: {refused}")
    ref = reference(scale_results, scale_assets_dir, case.moe)
    ranks_per_node = case.nprocs // NODES
    config, *job = job_args(scale_assets_dir, case.moe)
    start = time.monotonic()
    try:
        job_id, trial = submit_job(scale_results, case.name, config, [
            *placement(scale_results, case.name, "mpirun", NODES, ranks_per_node), f"slurm.partition={PARTITION}",
            *job, *FP32, *case.overrides()])
        state = wait_finished(job_id, 1500)
        assert state == "COMPLETED", f"job {job_id} ended {state}:\n{failure_report(trial)}"
        diff = difference(trial, ref)
    except AssertionError as failed:
        record(case.name, case.nodes, case.zero, None, str(failed))
        raise
    wall_seconds = time.monotonic() - start
    record(case.name, case.nodes, case.zero, diff)
    hosts = read_json(trial / "job.json")["attempts"][0]["hosts"]
    print(f"\nscale over two nodes: {case.name} (ZeRO-{case.zero}), job {job_id} on {hosts} x {ranks_per_node} ranks: "
          f"{wall_seconds:.0f} s from submission; weights {diff.weights:.2e} ({diff.weights_model}), statistic "
          f"{diff.stat:.2f}x allowed ({diff.stat_name})")
    assert len(set(hosts)) == NODES
    facts = rank_facts(trial)
    assert [f["rank"] for f in facts] == list(range(case.nprocs))
    assert [f["host"] for f in facts] == [hosts[r // ranks_per_node] for r in range(case.nprocs)]  # block placement
    assert diff.steps == 2
    assert diff.weights <= 2e-5, f"{diff.weights_model}: relative weight difference {diff.weights:.2e}"
    assert diff.stat <= 1.0, f"{diff.stat_name}: {diff.stat:.2f}x the allowed difference"
