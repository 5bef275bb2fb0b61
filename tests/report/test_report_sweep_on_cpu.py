"""restage report --sweep: one row per trial from index.json, a failed trial says why, a bar chart."""

from __future__ import annotations

import json

import pytest
from PIL import Image
from report_text import blocks, close_to_printed

from restage.cli import main as restage_main
from restage.errors import LogError
from restage.report.log import read_log
from restage.report.summary import summarize
from restage.report.sweep_report import read_sweep_index, sweep_rows
from restage.report.synthetic import write_synthetic_log


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    write_synthetic_log(root / "ws2" / "log.h5", steps=4, world_size=2, seed=1)
    write_synthetic_log(root / "ws4" / "log.h5", steps=4, world_size=4, seed=2, close=False)
    # as restage.launch.sweep writes it (trial, trial_dir, values), and one trial in the synonym keys
    trials = [{"index": 0, "trial": "ws2", "trial_dir": str(root / "ws2"), "values": {"world_size": 2, "actor.tp": 1},
               "job_id": "12_0"},
              {"index": 1, "trial": "ws4", "trial_dir": "ws4", "values": {"world_size": 4, "actor.tp": 2}, "job_id": "12_1"},
              {"name": "failed", "dir": "failed", "overrides": {"world_size": 8}}]
    (root / "index.json").write_text(json.dumps({"sweep": "test", "trials": trials}))
    return root


def test_rows_per_trial(sweep_dir):
    assert [t.name for t in read_sweep_index(sweep_dir)] == ["ws2", "ws4", "failed"]
    rows = sweep_rows(sweep_dir)
    for row, folder in zip(rows[:2], ("ws2", "ws4")):
        expected = summarize(read_log(sweep_dir / folder))["throughput"]["all"]
        assert row["samples_per_second"] == expected["samples_per_second"] and row["steps"] == 4
    assert rows[0]["status"] == "complete" and rows[1]["status"] == "not closed, up to step 4"  # of steps 1..4
    assert rows[2]["samples_per_second"] is None and "no log.h5" in rows[2]["status"]


def test_cli_text_json_and_png(sweep_dir, tmp_path, capsys):
    assert restage_main(["report", "--sweep", str(sweep_dir), "--json", "--png", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert Image.open(tmp_path / "sweep.png").size == (1000, 500) and report["plots"] == [str(tmp_path / "sweep.png")]
    assert restage_main(["report", "--sweep", str(sweep_dir)]) == 0
    header, *rows = blocks(capsys.readouterr().out)["sweep trials"]
    assert header[:3] == ["trial", "world_size", "actor.tp"]
    assert [r[:3] for r in rows] == [["ws2", "2", "1"], ["ws4", "4", "2"], ["failed", "8", "-"]]
    for row, trial in zip(rows[:2], report["trials"][:2]):
        assert close_to_printed(row[header.index("samples/s")], trial["samples_per_second"])


def test_bad_index_is_one_line(tmp_path):
    with pytest.raises(LogError, match="no index.json"):
        read_sweep_index(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"trials": [{"name": "x"}]}))
    with pytest.raises(LogError, match="trial 0 has no trial_dir"):
        read_sweep_index(tmp_path)
