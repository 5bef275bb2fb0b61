"""Data transfer over the control plane (MPI, as the runtime moves MFC outputs) on 8 real mpirun ranks."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from mpi_script import run_mpi_script
from transfer_cases import TRANSFERS_8, make_meta

from restage.runtime.dataplane.data_transfer import plan_transfer

pytestmark = pytest.mark.multirank

HERE = Path(__file__).resolve().parent


def test_every_transfer_case_is_delivered_exactly_over_mpi(tmp_path):
    out = tmp_path / "out.json"
    run_mpi_script(8, HERE / "transfer_mpi_ranks.py", str(out))
    results = json.loads(out.read_text())
    for i, (prod, cons, stages, n, group, what) in enumerate(TRANSFERS_8):
        plan = plan_transfer(make_meta(i, n, prod.strategy.dp, group), prod, cons, consumer_stages=stages,
                             world_size=8, assignment="contiguous", node_of=lambda r: r // 3)
        sent, received, delivered = Counter(), Counter(), set()
        for rank, per_rank in enumerate(results):
            r = per_rank[i]
            if r is None:
                assert rank not in (*prod.mesh, *cons.mesh), what
                continue
            assert r["wrong"] == [], (what, rank, r["wrong"])
            sent.update({(s, d): b for s, d, b in r["sent"]})
            received.update({(s, d): b for s, d, b in r["received"]})
            delivered |= set(r["samples"])
        assert dict(sent) == dict(received) == plan.bytes_by_link, what
        assert delivered == set(range(n)), what
