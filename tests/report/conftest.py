"""Logs the report tests run on: synthetic plans, short real runs on one and two ranks, and any real run's log.

Set RESTAGE_REPORT_LOGS to a colon-separated list of run directories (or log.h5 files) to run
every consistency test on those logs too, e.g. logs written by the runtime's e2e runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from restage.report.synthetic import write_synthetic_log

EXTRA_LOGS = [p for p in os.environ.get("RESTAGE_REPORT_LOGS", "").split(":") if p]


@pytest.fixture(scope="session")
def synthetic_log(tmp_path_factory) -> Path:
    """8 ranks, 30 steps, 5% noise on every duration."""
    return write_synthetic_log(tmp_path_factory.mktemp("synthetic") / "log.h5", steps=30, world_size=8, noise=0.05)


@pytest.fixture(scope="session")
def exact_log(tmp_path_factory) -> Path:
    """4 ranks, 5 steps, no noise: every duration is its base value (step 2.4 s)."""
    return write_synthetic_log(tmp_path_factory.mktemp("exact") / "log.h5", steps=5, world_size=4, noise=0.0)


def _real_run(results: Path, *args: str) -> Path:
    """A short real PPO run of the SPMD runtime (``restage run``); returns its trial directory."""
    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tests" / "runtime"))
    from runs import restage_run

    done = restage_run(results, "jobs/ppo_tiny.yaml", "run.steps=4", "run.batch_size=8", "trial=report", *args)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return results / "ppo-tiny" / "report"


@pytest.fixture(scope="session")
def single_rank_log(tmp_path_factory) -> Path:
    """A short real run of the runtime on one rank."""
    return _real_run(tmp_path_factory.mktemp("single"), "-n", "1")


@pytest.fixture(scope="session")
def multirank_log(tmp_path_factory) -> Path:
    """A short real run of the runtime on two ranks: the actor generates with dp2 and trains with tp2
    (a reallocation every step), data transfers between the layouts."""
    layouts = ["plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0 dp1",
               "plan.layouts.critic_inf=ranks:1 dp1", "plan.layouts.actor_train=ranks:0-1 tp2",
               "plan.layouts.critic_train=ranks:0-1 dp2"]
    return _real_run(tmp_path_factory.mktemp("multi"), "-n", "2", "plan.mode=manual", *layouts)


LOG_SOURCES = ["synthetic_log", "exact_log", "single_rank_log",
               pytest.param("multirank_log", marks=pytest.mark.multirank)] + [pytest.param(p, id=p) for p in EXTRA_LOGS]


@pytest.fixture(params=LOG_SOURCES)
def any_log(request) -> Path:
    """Each log source in turn (fixture names, or paths from RESTAGE_REPORT_LOGS)."""
    if request.param in EXTRA_LOGS:
        return Path(request.param)
    return request.getfixturevalue(request.param)
