"""The communicator bound of a plan: O(layouts x groups) at 128 GPUs, not one group per possible sender."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from realloc_cases import L, tiny

from restage.config.load import load_config
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule
from restage.runtime.dataplane.comm_budget import communicator_bound, pipeline_pairs, run_groups, singleton_ranks
from restage.schedule.ops import Realloc
from restage.schedule.realloc_plan import plan_reallocation, realloc_groups

# The layouts a search found for this job (manual here, so the test is fast and fixed): every MFC its own.
LAYOUTS_128 = {"actor_gen": "dp16tp8", "reward_inf": "dp128", "ref_inf": "dp32tp4", "critic_inf": "dp2tp4pp16",
               "actor_train": "tp8pp16", "critic_train": "tp4pp32"}


@pytest.fixture(scope="module")
def schedule_128(tmp_path_factory):
    # The actor recomputes its blocks: with every saved activation counted (plan/activations.py) its tp8pp16 training
    # beside the reference's dp32tp4 copy needs 80 GiB of the 72 usable otherwise.
    cfg = load_config("jobs/paper/ppo-70b-h100x128-gen128.yaml",
                      ["plan.mode=manual", "models.actor.gradient_checkpointing=true",
                       *[f"plan.layouts.{k}=ranks:0-127 {v}" for k, v in LAYOUTS_128.items()]])
    return build_schedule(cfg, make_plan(cfg, with_baselines=False))


def test_at_128_gpus_the_groups_are_the_layouts_groups_plus_one_per_reallocation(schedule_128):
    bound = communicator_bound(schedule_128)
    layouts = {e.mfc.name: e.layout for e in schedule_128.mfcs}
    per_layout = len({tuple(sorted(g)) for layout in layouts.values() for g in layout.all_groups()})
    reallocs = sum(1 for op in schedule_128.ops() if op.kind in ("realloc", "ema"))
    multi = [g for g in bound.groups if len(g) > 1]
    # Every layout spans all 128 ranks, so each reallocation's group is a mesh the layouts already have.
    assert len(multi) == per_layout == 127 and reallocs == 2
    assert per_layout <= sum(s.dp * s.tp + s.tp * s.pp + s.dp * s.pp + s.dp + 1
                             for s in (layout.strategy for layout in layouts.values()))
    # Single-rank groups only where a trainable model's degree is 1 (here both train with dp=1: all ranks).
    assert [g for g in bound.groups if len(g) == 1] == [(r,) for r in range(128)]
    # Before: 4,733 groups (125 layout groups, 128 broadcast groups, 4,352 for the transfers' possible senders
    # and 128 singletons).
    assert bound.max_groups == 255 and bound.max_communicators == 256
    # Pairs: the pipeline's neighbours and the reallocations' links, nothing for data transfers (MPI).
    assert pipeline_pairs(layouts.values()) <= bound.pairs
    assert bound.max_pairs == 7744


def test_a_reallocation_needs_one_group_whatever_its_receivers():
    plan = plan_reallocation(tiny(), L(range(4), tp=4), L(range(2, 8), dp=2, tp=3), bytes_per_element=2)
    assert realloc_groups(plan) == [tuple(range(8))]
    op = Realloc(plan.ranks, "actor", plan.src, plan.dst)
    assert run_groups([plan.src, plan.dst], [op]) == sorted(
        {tuple(sorted(g)) for layout in (plan.src, plan.dst) for g in layout.all_groups()} | {tuple(range(8))})


def test_single_rank_groups_only_for_trainable_models_with_a_degree_of_one():
    def model(layout, trainable):
        return SimpleNamespace(trainable=trainable, home_layout=layout)

    schedule = SimpleNamespace(models={"actor": model(L(range(4), dp=2, tp=2), True),   # dp 2, tp 2: none
                                       "critic": model(L(range(4, 8), dp=4), True),      # tp = 1: needs them
                                       "ref": model(L((8,)), False)})                    # frozen: never
    assert singleton_ranks(schedule) == [4, 5, 6, 7]
