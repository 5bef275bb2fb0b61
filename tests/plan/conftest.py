"""Fixtures of the plan tests (helpers live in plan_helpers.py)."""

import pytest

from restage.cluster import load_cluster


@pytest.fixture
def h100():
    return load_cluster("h100-80gb")
