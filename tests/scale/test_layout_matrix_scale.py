"""Every training layout class at 8 ranks (and a few at 16), each ZeRO stage the feasibility rule allows, equal to a
one-rank run of the same job after 2 steps (scale_jobs: the job, the tolerance and why it is exact).

``make test`` runs the cases in ``CORE`` (the 3-D layout that crashed at start-up, under ZeRO-3); ``make test-scale``
(``pytest --scale tests/scale``) runs them all. With
``RESTAGE_SCALE_REPORT=FILE`` each case appends its figures to FILE as a JSON line (the table in docs/runtime.md, "Scale").
"""

from __future__ import annotations

import re

import pytest
from scale_jobs import Case, difference, job_args, record, reference, run

from restage.layout import Strategy
from restage.models.sharding import layout_problem

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

ALL8 = "ranks:0-7"


def _same(strategy: str, ranks: str = ALL8, gen: str | None = None) -> dict[str, str]:
    """Every MFC at ``strategy`` (generation at ``gen`` if given) over ``ranks``; the critic, a dense model, without
    the strategy's expert parallelism."""
    layout, dense = f"{ranks} {strategy}", f"{ranks} {re.sub(r'ep[0-9]+', '', strategy)}"
    return {"actor_gen": f"{ranks} {gen or strategy}", "ref_inf": layout, "critic_inf": dense,
            "actor_train": layout, "critic_train": dense}


# Training layout classes at 8 ranks; generation in the data-parallel layout restage's planner prefers for it.
TRAIN_8 = {"dp": "dp8", "tp": "dp2tp4", "pp": "dp2pp4", "dp_tp": "dp4tp2", "dp_pp": "dp4pp2", "tp_pp": "dp1tp2pp4",
           "dp_tp_pp": "dp2tp2pp2"}
CASES: list[Case] = []
for cls, train in TRAIN_8.items():
    for zero in (0, 1, 2, 3):
        CASES.append(Case(f"{cls}-{train}-zero{zero}", 8, _same(train, gen="dp8"), zero))
# The command: generation, reference and critic each in their own layout over the same 8 ranks.
CASES.append(Case("issue-mixed-3d", 8, {"actor_gen": "ranks:0-7 dp4tp2pp1", "ref_inf": "ranks:0-7 dp4tp1pp2",
                                         "critic_inf": "ranks:0-7 dp2tp2pp2", "actor_train": "ranks:0-7 dp2tp2pp2",
                                         "critic_train": "ranks:0-7 dp2tp2pp2"}, 1))
# Disjoint meshes: the critic on ranks 4-7 while the actor trains on 0-3, then generation over all 8.
CASES.append(Case("disjoint-halves", 8, {"actor_gen": "ranks:0-7 dp8", "ref_inf": "ranks:4-7 dp2pp2",
                                          "critic_inf": "ranks:4-7 dp2tp2", "actor_train": "ranks:0-3 dp1tp2pp2",
                                          "critic_train": "ranks:4-7 dp2tp2"}, 2))
# Generation in place: the actor generates in its own ZeRO-3 training layout.
CASES.append(Case("gen-in-place-zero3", 8, _same("dp4tp2"), 3))
# Mixture of experts: ep x pp and ep x tp (ZeRO-3 takes no expert groups, so stage 2).
CASES.append(Case("moe-ep2xpp2", 8, _same("dp4ep2pp2", gen="dp8"), 2, moe=True))
CASES.append(Case("moe-ep2xtp2", 8, _same("dp4ep2tp2", gen="dp4ep2tp2"), 2, moe=True))
CASES.append(Case("moe-ep4", 8, _same("dp8ep4", gen="dp8ep2"), 1, moe=True))
# LoRA at tp2 x pp2.
CASES.append(Case("lora-tp2pp2", 8, _same("dp2tp2pp2", gen="dp8"), 1,
                  extra=("models.actor.lora.rank=4", "models.actor.lora.alpha=8")))
# 16 ranks on one node (the two-node runs are in tests/multinode): dp2 x tp2 x pp4 training beside dp8 x tp2 generation.
CASES.append(Case("16-dp2tp2pp4-gen-dp8tp2", 16, {**_same("dp2tp2pp4", "ranks:0-15"),
                                                    "actor_gen": "ranks:0-15 dp8tp2"}, 1))
CASES.append(Case("16-dp4tp4-zero3", 16, _same("dp4tp4", "ranks:0-15", gen="dp16"), 3))

# In make test (time-bounded): the 3-D layout that crashed at start-up (under ZeRO-3, which also hung under pp); dp8
# ZeRO-3 generating in place and MoE ep x pp (86 s and 72 s) are in make test-scale with the rest.
CORE = {"dp_tp_pp-dp2tp2pp2-zero3"}


def _feasible(case: Case, assets) -> str | None:
    """The feasibility rule's refusal of the case's training layouts, if any (such a case is skipped, named)."""
    from restage.models.arch import ModelConfig

    cfg = ModelConfig.from_pretrained(assets[1] if case.moe else assets[0])
    for mfc in ("actor_train", "critic_train"):
        strategy = Strategy.parse(case.layouts[mfc].split()[1])
        model_cfg = ModelConfig.from_pretrained(assets[0]) if mfc == "critic_train" else cfg
        problem = layout_problem(mfc, model_cfg, strategy, case.nprocs, trained=True, zero_stage=case.zero)
        if problem:
            return problem
    return None


def _param(case: Case):
    marks = [] if case.name in CORE else [pytest.mark.scale]
    return pytest.param(case, id=case.name, marks=marks)


@pytest.fixture(scope="session")
def scale_results(tmp_path_factory):
    return tmp_path_factory.mktemp("scale")


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_layout_equals_one_rank_run(case: Case, scale_results, scale_assets_dir):
    refused = _feasible(case, scale_assets_dir)
    if refused:
        pytest.skip(f"the feasibility rule refuses it: {refused}")
    ref = reference(scale_results, scale_assets_dir, case.moe, tuple(o for o in case.extra if ".lora." in o))
    try:
        trial = run(scale_results, case.name, case.nprocs, [*job_args(scale_assets_dir, case.moe), *case.overrides()])
        diff = difference(trial, ref)
    except AssertionError as failed:
        record(case.name, case.nodes, case.zero, None, str(failed))
        raise
    record(case.name, case.nodes, case.zero, diff)
    assert diff.steps == 2
    assert diff.weights <= 2e-5, f"{diff.weights_model}: relative weight difference {diff.weights:.2e}"
    assert diff.stat <= 1.0, f"{diff.stat_name}: {diff.stat:.2f}x the allowed difference"
