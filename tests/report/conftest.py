"""Logs the report tests run on: synthetic plans, short real runs on one and two ranks, and any real run's log.

Set RESTAGE_REPORT_LOGS to a colon-separated list of run directories (or log.h5 files) to run
every consistency test on those logs too, e.g. logs written by the runtime's e2e runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import runs_for_report

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


@pytest.fixture(scope="session")
def single_rank_log(tmp_path_factory) -> Path:
    """A short real run on one rank (timed matmuls), logged as the master does."""
    path = tmp_path_factory.mktemp("single") / "log.h5"
    runs_for_report.run(0, 1, str(path))
    return path


@pytest.fixture(scope="session")
def multirank_log(tmp_path_factory) -> Path:
    """A short real run on two gloo ranks: concurrent MFCs, a broadcast reallocation and a send/recv transfer."""
    from restage.runtime.spawn import spawn

    path = tmp_path_factory.mktemp("multi") / "log.h5"
    spawn(runs_for_report.run, 2, str(path), timeout_seconds=120)
    return path


LOG_SOURCES = ["synthetic_log", "exact_log", "single_rank_log",
               pytest.param("multirank_log", marks=pytest.mark.multirank)] + [pytest.param(p, id=p) for p in EXTRA_LOGS]


@pytest.fixture(params=LOG_SOURCES)
def any_log(request) -> Path:
    """Each log source in turn (fixture names, or paths from RESTAGE_REPORT_LOGS)."""
    if request.param in EXTRA_LOGS:
        return Path(request.param)
    return request.getfixturevalue(request.param)
