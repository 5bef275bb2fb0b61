"""A trial keeps its data's fingerprint (data.json); `restage run --resume` refuses data changed at the same path
(rows reordered, edited), takes the same data, and with --accept-changed-data continues and records the change."""

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from restage.cli import main as restage_main
from restage.config.load import config_from_dict
from restage.data.fingerprint import Fingerprint, difference, fingerprint
from restage.demo import ensure_tiny_model
from restage.errors import ConfigError
from restage.launch import local
from restage.launch.data_check import DATA_FILE, check_trial_data

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"prompt": f"sort {i} {i + 1} :", "answer": str(i)} for i in range(6)]


def _parquet(path: Path, rows) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(data: Path, **dataset):
    return config_from_dict({"experiment": "x", "algorithm": "grpo", "models": {"actor": {"path": "p"}},
                             "dataset": {"path": str(data), **dataset}})


@pytest.mark.parametrize("write", [_parquet, _jsonl], ids=["parquet", "jsonl"])
def test_the_fingerprint_tells_reordered_edited_and_added_rows_from_the_same_rows(tmp_path, write):
    suffix = ".parquet" if write is _parquet else ".jsonl"
    first = fingerprint(write(tmp_path / f"a{suffix}", ROWS))
    assert (first.rows, first.size_bytes) == (6, (tmp_path / f"a{suffix}").stat().st_size)
    assert first.same_data(fingerprint(write(tmp_path / f"b{suffix}", ROWS)))  # same rows, another file
    reordered = fingerprint(write(tmp_path / f"c{suffix}", ROWS[::-1]))
    assert difference(first, reordered).startswith("the same 6 rows in another order (content hash ")
    edited = fingerprint(write(tmp_path / f"d{suffix}", [*ROWS[:5], {**ROWS[5], "answer": "x"}]))
    assert difference(first, edited).startswith("6 rows both, but not the same rows")
    assert difference(first, fingerprint(write(tmp_path / f"e{suffix}", ROWS + ROWS[:1]))).startswith("6 -> 7 rows")
    assert Fingerprint.from_dict(json.loads(json.dumps(first.to_dict()))) == first


def test_resume_refuses_changed_data_takes_the_same_and_records_an_accepted_change(tmp_path):
    data, trial = _parquet(tmp_path / "q.parquet", ROWS), tmp_path / "trial"
    cfg = _cfg(data)
    assert check_trial_data(trial, cfg, resume=False, accept_changed=False) == []
    saved = json.loads((trial / DATA_FILE).read_text())
    assert saved["sources"]["dataset.path"]["rows"] == 6 and saved["accepted_changes"] == []
    assert check_trial_data(trial, cfg, resume=True, accept_changed=False, resume_step=2) == []  # the same data
    before = (trial / DATA_FILE).read_text()

    _parquet(data, ROWS[::-1])
    with pytest.raises(ConfigError) as err:
        check_trial_data(trial, cfg, resume=True, accept_changed=False, resume_step=2)
    message = str(err.value)
    assert message.startswith(f"--resume: dataset.path {data} changed since checkpoint step-2 was trained on it: the "
                              "same 6 rows in another order (content hash ")
    assert "--accept-changed-data" in message and "\n" not in message
    assert (trial / DATA_FILE).read_text() == before  # a refusal writes nothing

    lines = check_trial_data(trial, cfg, resume=True, accept_changed=True, resume_step=2)
    assert len(lines) == 1 and lines[0].startswith("restage: --accept-changed-data: continuing on changed data: "
                                                   f"dataset.path {data} changed since checkpoint step-2")
    record = json.loads((trial / DATA_FILE).read_text())
    assert [(c["checkpoint_step"], list(c["changes"])) for c in record["accepted_changes"]] == [(2, ["dataset.path"])]
    assert record["accepted_changes"][0]["before"]["dataset.path"] == saved["sources"]["dataset.path"]
    assert record["sources"]["dataset.path"]["content"] != saved["sources"]["dataset.path"]["content"]
    assert check_trial_data(trial, cfg, resume=True, accept_changed=False, resume_step=3) == []  # the new data now


def test_a_held_out_file_is_fingerprinted_too(tmp_path):
    data, held = _jsonl(tmp_path / "t.jsonl", ROWS), _jsonl(tmp_path / "e.jsonl", ROWS[:2])
    trial = tmp_path / "trial"
    cfg = _cfg(data, eval_path=str(held))
    check_trial_data(trial, cfg, resume=False, accept_changed=False)
    _jsonl(held, ROWS[1:3])
    with pytest.raises(ConfigError, match=f"dataset.eval_path {held} changed since the checkpoint was trained on it: "
                                          "2 rows both, but not the same rows"):
        check_trial_data(trial, cfg, resume=True, accept_changed=False)


def test_restage_run_resume_refuses_reordered_data_in_one_line_before_ranks(tmp_path, monkeypatch, capsys):
    ensure_tiny_model(ROOT)
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"sort {i} {j} :"} for i in range(4) for j in range(4)])
    started: list[bool] = []
    monkeypatch.setattr(local, "launch", lambda *a, **k: started.append(True) or 0)  # no ranks: the checks only
    argv = ["run", str(ROOT / "jobs" / "grpo_tiny.yaml"), "-n", "1", f"run.results_dir={tmp_path}", "trial=t",
            f"dataset.path={data}", "run.batch_size=2"]
    assert restage_main(argv) == 0 and started == [True]
    trial = tmp_path / "grpo-tiny" / "t"
    (trial / "checkpoints" / "step-1").mkdir(parents=True)  # what a run that saved step 1 leaves
    (trial / "checkpoints" / "step-1" / "manifest.json").write_text('{"step": 1}')
    capsys.readouterr()
    assert restage_main([*argv, "--resume"]) == 0 and started == [True, True]  # the same data
    lines = data.read_text().splitlines()
    data.write_text("\n".join(lines[1:] + lines[:1]) + "\n")
    began = time.monotonic()
    assert restage_main([*argv, "--resume"]) == 2 and started == [True, True]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"restage: error: --resume: dataset.path {data} changed since "
                                               "checkpoint step-1 was trained on it: the same 16 rows in another order")
    assert time.monotonic() - began < 30
    assert restage_main([*argv, "--resume", "--accept-changed-data"]) == 0 and len(started) == 3
    assert "restage: --accept-changed-data: continuing on changed data" in capsys.readouterr().out


def test_restage_submit_resume_refuses_reordered_data_before_anything_is_queued(tmp_path, capsys):
    from restage.config.load import load_config

    ensure_tiny_model(ROOT)
    data = _jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"sort {i} {j} :"} for i in range(4) for j in range(4)])
    overrides = [f"run.results_dir={tmp_path}", "trial=s", f"dataset.path={data}", "run.batch_size=2"]
    cfg = load_config(ROOT / "jobs" / "grpo_tiny.yaml", overrides)
    check_trial_data(cfg.trial_dir, cfg, resume=False, accept_changed=False)  # what the first submit recorded
    (cfg.trial_dir / "checkpoints" / "step-3").mkdir(parents=True)
    (cfg.trial_dir / "checkpoints" / "step-3" / "manifest.json").write_text('{"step": 3}')
    data.write_text("".join(reversed(data.read_text().splitlines(keepends=True))))
    assert restage_main(["submit", str(ROOT / "jobs" / "grpo_tiny.yaml"), *overrides, "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"restage: error: --resume: dataset.path {data} changed since "
                                               "checkpoint step-3 was trained on it: the same 16 rows in another order")
    assert not (cfg.trial_dir / "submission.json").exists() and not (cfg.trial_dir / "slurm").exists()
