"""Consistency of the report on every log source (synthetic, real one- and two-rank runs, RESTAGE_REPORT_LOGS)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from report_text import blocks, close_to_printed

from restage.cli import main as restage_main
from restage.report import journal
from restage.report.log import resolve_log_path


def raw_tables(path):
    """Complete steps' rows read with h5py and the journal's lines directly, not through the reader under test."""
    path = resolve_log_path(path)
    with h5py.File(path, "r", locking=False) as f:
        last = int(f.attrs["last_complete_step"])
        tables = {name: f[name][:] for name in ("steps", "mfcs", "transfers")}
        world_size = int(f.attrs["world_size"])
        journal_id = str(f.attrs.get("journal_id", ""))
    tables = {name: rows[rows["step"] <= last] for name, rows in tables.items()}
    for record in journal.read(journal.journal_path(path), journal_id):  # steps of a run still going or crashed
        for name, rows in tables.items():
            added = np.array([tuple(v.encode() if isinstance(v, str) else v for v in row) for row in record[name]],
                             dtype=rows.dtype)  # strings as h5py gives them: bytes
            tables[name] = np.concatenate([rows, added])
    return tables, world_size


def report_json(path, *extra) -> dict:
    return json.loads(run_cli(str(path), "--json", *extra))


def run_cli(*argv) -> str:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert restage_main(["report", *argv]) == 0
    return out.getvalue()


def test_tokens_and_samples_per_second_are_logged_totals_over_wall_time(any_log):
    tables, world_size = raw_tables(any_log)
    steps = tables["steps"]
    wall = float((steps["end_seconds"] - steps["start_seconds"]).sum())
    report = report_json(any_log, "--last", "3")
    overall, last = report["throughput"]["all"], report["throughput"]["last"]
    assert overall["steps"] == len(steps)
    assert overall["tokens_per_second"] == pytest.approx(steps["tokens"].sum() / wall, rel=1e-12)
    assert overall["samples_per_second"] == pytest.approx(steps["samples"].sum() / wall, rel=1e-12)
    flops = steps["flops"].sum() if steps["flops"].any() else tables["mfcs"]["flops"].sum()
    assert overall["tflops_per_device"] == pytest.approx(flops / wall / world_size / 1e12, rel=1e-12)
    tail = np.sort(steps, order="step")[-3:]
    assert last["tokens_per_second"] == pytest.approx(tail["tokens"].sum() / (tail["end_seconds"] - tail["start_seconds"]).sum(),
                                                      rel=1e-12)


def test_each_ranks_shares_sum_to_at_most_one_and_match_the_rows(any_log):
    tables, world_size = raw_tables(any_log)
    steps = tables["steps"]
    wall = float((steps["end_seconds"] - steps["start_seconds"]).sum())
    report = report_json(any_log)
    assert sorted(int(r) for r in report["shares"]) == list(range(world_size))
    for rank, share in report["shares"].items():
        assert sum(share["mfcs"].values()) + share["realloc"] + share["transfer"] <= 1.0 + 1e-9, rank
        assert share["total"] + share["idle"] == pytest.approx(1.0)
        mine = tables["mfcs"][tables["mfcs"]["rank"] == int(rank)]
        for name, value in share["mfcs"].items():
            rows = mine[mine["name"] == name.encode()]
            assert value == pytest.approx((rows["end_seconds"] - rows["start_seconds"]).sum() / wall, abs=1e-12), (rank, name)


def test_json_and_text_table_agree(any_log):
    report = report_json(any_log, "--last", "2")
    text = blocks(run_cli(str(any_log), "--last", "2"))
    rows = {row[0]: row[1:] for row in text["throughput"][1:]}
    for label, key in (("wall seconds", "wall_seconds"), ("samples/s", "samples_per_second"),
                       ("tokens/s", "tokens_per_second"), ("TFLOP/s per device", "tflops_per_device"),
                       ("step seconds (mean)", "step_seconds_mean")):
        for cell, column in zip(rows[label], ("all", "last")):
            assert close_to_printed(cell, report["throughput"][column][key]), (label, column, cell)
    mfu_row = next(cells for label, cells in rows.items() if label.startswith("MFU"))
    if report["throughput"]["all"]["mfu"] is not None:
        assert close_to_printed(mfu_row[0], 100 * report["throughput"]["all"]["mfu"])
    column = {name: i for i, name in enumerate(text["MFCs"][0])}
    mfc_rows = {row[0]: row for row in text["MFCs"][1:]}
    assert list(mfc_rows) == [m["name"] for m in report["mfcs"]]
    for m in report["mfcs"]:
        row = mfc_rows[m["name"]]
        assert close_to_printed(row[column["measured s"]], m["measured_seconds"])
        assert close_to_printed(row[column["peak mem GiB"]], m["peak_memory_bytes"] / 2**30)
        if m["predicted_seconds"] is not None:
            assert close_to_printed(row[column["predicted s"]], m["predicted_seconds"])
            assert close_to_printed(row[column["error %"]], m["error_percent"])
        if m["predicted_band_seconds"] is not None:
            low, high = row[column["likely s"]].split()[0].split("-")
            assert close_to_printed(low, m["predicted_band_seconds"][0])
            assert close_to_printed(high, m["predicted_band_seconds"][1])
        if m["memory_compared"]:
            assert close_to_printed(row[column["pred mem GiB"]], m["predicted_peak_memory_bytes"] / 2**30)
    header, *share_rows = text["time share per rank"]
    assert len(share_rows) == len(report["shares"])
    for row in share_rows:
        share = report["shares"][row[0]]
        for column, cell in zip(header[1:], row[1:]):
            value = share["mfcs"][column] if column in share["mfcs"] else share[column]
            assert close_to_printed(cell, 100 * value), (row[0], column)
