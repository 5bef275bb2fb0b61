"""A rank waiting for a late peer in the control plane or an MPI transfer sleeps instead of spinning.

Open MPI's blocking calls busy-poll. A spinning rank starves every thread bound to its core: on the
multinode test cluster (nodes sharing this machine's cores) a peer's gloo I/O threads got no CPU while
a rank spun in MPI, and steps took 100-180 s instead of seconds. Without ``control.wait_quietly`` the
waiting rank below burns about as much CPU as it waits.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mpi_script import run_mpi_script

pytestmark = pytest.mark.multirank

HERE = Path(__file__).resolve().parent
LATE_SECONDS = 2.0  # as in quiet_wait_ranks.py


def test_waiting_for_a_late_peer_costs_almost_no_cpu(tmp_path):
    out = tmp_path / "out.json"
    run_mpi_script(2, HERE / "quiet_wait_ranks.py", str(out), timeout_seconds=300)
    result = json.loads(out.read_text())
    assert result.pop("received") == 1.0
    values = result.pop("values")  # the object collectives deliver what blocking ones would (JSON: lists)
    assert [v["bcast"] for v in values] == [{"ids": [3, 1]}] * 2
    assert values[0]["gather"] == [["rank", 0, ""], ["rank", 1, "x" * 1000]] and values[1]["gather"] is None
    assert [v["allgather"] for v in values] == [[[0], None]] * 2
    assert set(result) == {"bcast", "gather", "allgather", "barrier", "receive"}
    for what, t in result.items():
        assert t["wall_seconds"] >= 0.8 * LATE_SECONDS, (what, t)  # it did wait for the late peer
        # A spinning wait costs as much CPU as the share of a core it gets (most of the wait on an idle
        # machine); sleeping between tests costs a few percent at most.
        assert t["cpu_seconds"] < 0.05 * t["wall_seconds"], (what, t)
