"""A real 4-rank run creates no more process groups and point-to-point rank pairs than the plan's bound."""

import json
from pathlib import Path

import pytest
from runs import ROOT, restage_run
from test_spmd_layouts import COMMON, FOUR

from restage.runtime.dataplane.comm_budget import communicator_bound
from restage.schedule.file import read_schedule

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

HOOK = Path(__file__).resolve().parent / "comm_hook"


def test_a_four_rank_run_stays_within_its_communicator_bound(tmp_path):
    counts = tmp_path / "counts"
    counts.mkdir()
    env = {"RESTAGE_TEST_COMM_LOG": str(counts),
           "PYTHONPATH": f"{HOOK}:{ROOT / 'tests' / 'runtime'}:{ROOT / 'src'}"}
    # Data-parallel training layouts too, so DeepSpeed's own groups and the dp reductions are counted.
    layouts = [*FOUR[:-2], "plan.layouts.actor_train=ranks:0-3 dp2tp2", "plan.layouts.critic_train=ranks:2-3 dp2"]
    run = restage_run(tmp_path, *COMMON, "run.steps=2", "-n", "4", "trial=four", *layouts, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    bound = communicator_bound(read_schedule(tmp_path / "ppo-tiny" / "four" / "schedule.json"))
    assert bound.summary() in run.stdout + run.stderr  # the runtime logs it at start
    ranks = [json.loads((counts / f"rank{r}.json").read_text()) for r in range(4)]
    groups = ranks[0]["groups"]
    assert all(r["groups"] == groups for r in ranks)  # new_group is collective: every rank made the same calls
    assert 0 < len(groups) <= bound.max_groups
    assert sorted(map(tuple, groups)) == sorted(bound.groups)  # exactly the groups the bound names, nothing else
    pairs = {tuple(p) for r in ranks for p in r["batched"] + r["unbatched"]}
    assert pairs and pairs <= bound.pairs
    assert all(r["unbatched"] == [] for r in ranks)  # every send and receive was batched: no per-pair communicator
