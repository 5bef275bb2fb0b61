"""A layout fuzzer: seeded random plans drawn from the planner's own candidates at 8 ranks (every mesh and strategy
``PlanProblem.candidates`` offers each MFC, and a ZeRO stage per trained model that the feasibility rule takes), each
run 2 steps and compared with the one-rank run (scale_jobs: the job, the tolerance and why it is exact).

A drawn plan the start-up check refuses as a whole (``build_schedule`` + ``schedule_problem``) is drawn again from
the next sub-seed, so every seed runs one plan the runtime accepts. A failing seed prints its plan and the command
that replays it: ``RESTAGE_FUZZ_SEEDS=<seed> pytest --scale tests/scale/test_layout_fuzz_scale.py``.
``make test-scale`` runs seeds 0..RESTAGE_FUZZ_COUNT-1 (default 8).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random

import pytest
from scale_jobs import ROOT, TRAINED, Case, difference, job_args, record, reference, run

from restage.config.load import load_config
from restage.config.sections import ClusterRef
from restage.models.sharding import layout_problem

pytestmark = [pytest.mark.multirank, pytest.mark.e2e, pytest.mark.scale]

WORLD = 8
SEEDS = ([int(s) for s in os.environ["RESTAGE_FUZZ_SEEDS"].split(",")] if os.environ.get("RESTAGE_FUZZ_SEEDS")
         else list(range(int(os.environ.get("RESTAGE_FUZZ_COUNT", "8")))))
MAX_DRAWS = 50


def _ranks(layout) -> str:
    mesh = layout.mesh
    return f"ranks:{mesh[0]}-{mesh[-1]}" if mesh == tuple(range(mesh[0], mesh[0] + len(mesh))) else \
        "ranks:" + ",".join(map(str, mesh))


def draw_case(seed: int, assets) -> tuple[Case, int]:
    """The plan of ``seed`` (and how many draws it took): one candidate per MFC and a ZeRO stage per trained model."""
    from restage.plan.planner import build_problem, make_plan
    from restage.plan.schedule import build_schedule
    from restage.runtime.store.feasibility import schedule_problem

    with contextlib.chdir(ROOT):
        base = load_config("jobs/ppo_tiny.yaml", job_args(assets)[1:])
        base = dataclasses.replace(base, cluster=ClusterRef("local-cpu", 1, WORLD))
        problem = build_problem(base)
        problem.keep_per_size = 64  # every strategy of each mesh size, not only the fastest few
        rng = random.Random(seed)
        for draw in range(1, MAX_DRAWS + 1):
            layouts = {}
            for mfc in problem.mfcs:
                candidate = rng.choice(problem.candidates(mfc))
                layouts[mfc.name] = f"{_ranks(candidate.layout)} {candidate.layout.strategy}"
            homes = {m.model: layouts[m.name] for m in problem.mfcs if m.kind == "train_step"}
            zero = rng.choice([z for z in (0, 1, 2, 3) if all(
                layout_problem(model, problem.roles[model].arch, _strategy(homes[model]), WORLD, trained=True,
                               zero_stage=z) is None for model in TRAINED)] or [0])
            case = Case(f"fuzz-seed{seed}", WORLD, layouts, zero)
            try:
                cfg = load_config("jobs/ppo_tiny.yaml", [*job_args(assets)[1:], f"run.nprocs={WORLD}", *case.overrides()])
                cfg = dataclasses.replace(cfg, cluster=base.cluster)
                schedule = build_schedule(cfg, make_plan(cfg, with_baselines=False))
                refused = schedule_problem(schedule, WORLD)
            except Exception as err:  # noqa: BLE001  (any refusal of the whole plan: draw again)
                refused = str(err)
            if refused is None:
                return case, draw
    raise AssertionError(f"seed {seed}: no plan the runtime takes in {MAX_DRAWS} draws")


def _strategy(text: str):
    from restage.layout import Strategy

    return Strategy.parse(text.split()[1])


@pytest.fixture(scope="module")
def fuzz_results(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@pytest.mark.parametrize("seed", SEEDS, ids=[f"seed{s}" for s in SEEDS])
def test_fuzzed_plan_equals_one_rank_run(seed, fuzz_results, scale_assets_dir):
    case, draws = draw_case(seed, scale_assets_dir)
    replay = f"RESTAGE_FUZZ_SEEDS={seed} pytest --scale tests/scale/test_layout_fuzz_scale.py"
    plan = ", ".join(f"{m}={v}" for m, v in case.layouts.items())
    print(f"seed {seed} ({draws} draw(s)): zero {case.zero}; {plan}")
    ref = reference(fuzz_results, scale_assets_dir)
    try:
        trial = run(fuzz_results, case.name, WORLD, [*job_args(scale_assets_dir), *case.overrides()])
        diff = difference(trial, ref)
    except AssertionError as failed:
        record(f"{case.name}: {plan}", 1, case.zero, None, str(failed))
        raise AssertionError(f"seed {seed} failed ({plan}, zero {case.zero}); replay: {replay}\n{failed}") from None
    record(f"{case.name}: {plan}", 1, case.zero, diff)
    assert diff.within(), f"seed {seed} ({plan}, zero {case.zero}): {diff}; replay: {replay}"
