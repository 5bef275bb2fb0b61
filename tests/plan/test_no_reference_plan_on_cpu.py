"""`restage plan jobs/grpo_tiny.yaml algo.kl_coef=0`: one model fewer, no ref MFC, in the plan and every peer's."""

from pathlib import Path

import pytest

from restage.config.load import load_config
from restage.demo import ensure_tiny_model
from restage.plan.peers.baselines import all_baselines
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule
from restage.schedule.ops import Ema, Realloc, Run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def at_root(monkeypatch):
    ensure_tiny_model(ROOT)
    monkeypatch.chdir(ROOT)  # the job's paths are relative to the repository root


def _plan(*overrides):
    cfg = load_config(ROOT / "jobs" / "grpo_tiny.yaml", ["plan.time_budget_seconds=2", *overrides])
    outcome = make_plan(cfg, seed=1)
    return outcome, build_schedule(cfg, outcome)


def test_grpo_tiny_at_kl_0_plans_no_reference(at_root, capsys):
    outcome, schedule = _plan("algo.kl_coef=0")
    assert capsys.readouterr().err.splitlines() == [
        "restage: models.ref is unused, so not planned or loaded: algo.kl_coef is 0, so grpo computes no KL to a "
        "reference model"]
    assert set(outcome.problem.roles) == {"actor"} and set(schedule.models) == {"actor"}
    assert [m.mfc.name for m in schedule.mfcs] == ["actor_gen", "actor_train"]
    assert "ref_logprobs" not in schedule.mfcs[1].mfc.inputs
    for step in schedule.steps:
        assert not isinstance(step.op, Ema) and getattr(step.op, "model", "actor") == "actor"
        assert not isinstance(step.op, Run) or step.op.mfc != "ref_inf"
    # The peers' plans follow the graph: none places a reference model.
    for name, found in all_baselines(outcome.problem).items():
        assert found is not None, name
        assert [c.mfc for c in found[0]] == ["actor_gen", "actor_train"], name

    with_ref, with_ref_schedule = _plan()  # the job's own kl_coef 0.01
    assert set(with_ref.problem.roles) == {"actor", "ref"} and set(with_ref_schedule.models) == {"actor", "ref"}
    assert [m.mfc.name for m in with_ref_schedule.mfcs] == ["actor_gen", "ref_inf", "actor_train"]
    assert outcome.evaluation.iteration_seconds < with_ref.evaluation.iteration_seconds
    assert not any(isinstance(s.op, Realloc) and s.op.model == "ref" for s in schedule.steps)
