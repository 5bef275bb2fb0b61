"""Dashboards copy log.h5's scalars: TensorBoard's own event reader reads back what read_log reads."""

from pathlib import Path

import numpy as np
import pytest

from restage.config.load import config_from_dict
from restage.report import dashboards
from restage.report.log import read_log
from restage.report.log_writer import LogWriter


def cfg_with(**section):
    return config_from_dict({"experiment": "dash", "algorithm": "sft", "models": {"actor": {"path": "p"}},
                             "dashboards": section})


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the event files, read by the tensorboard package's own reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def write_steps(trial: Path, cfg, steps: range, resume_step=None) -> None:
    log = LogWriter(trial, world_size=2, resume_step=resume_step, overwrite=resume_step is None)
    dashboards.attach(log, cfg, trial, resume_step)
    for step in steps:
        t = 10.0 * step
        for rank in (0, 1):
            log.mfc(step, "actor_gen", "actor", "generate", rank, t + 0.1 * rank, t + 1.5 + 0.2 * rank, tokens=10)
            log.mfc(step, "actor_train", "actor", "train_step", rank, t + 2.0, t + 3.25 + 0.5 * rank)
        log.stats(step, {"actor_train/loss": 1.0 / step + 1e-9, "actor_train/reward": 0.1 * step})
        if step % 2 == 0:
            log.stats(step, {"eval/reward": 0.3 * step})
        log.end_step(step, t, t + 4.0 + 0.01 * step, samples=8, tokens=80)
    log.close()


def test_tensorboard_reads_the_same_scalars_as_log_h5(tmp_path):
    trial = tmp_path / "trial"
    write_steps(trial, cfg_with(tensorboard=True), range(1, 5))
    board = tensorboard_scalars(trial / "tensorboard")
    run = read_log(trial)
    series = run.stat_series()
    assert set(series) == {"actor_train/loss", "actor_train/reward", "eval/reward"}
    for name, (steps, values) in series.items():
        assert [s for s, _ in board[name]] == steps.tolist()
        assert np.array_equal(np.float32([v for _, v in board[name]]), values.astype(np.float32)), name
    assert [s for s, _ in board["eval/reward"]] == [2, 4]
    # plus the step's and each MFC's seconds (first start to last end over the ranks)
    step_seconds = (run.steps["end_seconds"] - run.steps["start_seconds"]).astype(np.float32)
    assert np.allclose([v for _, v in board["time/step_seconds"]], step_seconds)
    assert [v for _, v in board["time/actor_gen_seconds"]] == pytest.approx([1.7] * 4)
    assert [v for _, v in board["time/actor_train_seconds"]] == pytest.approx([1.75] * 4)


def test_a_resumed_run_purges_the_steps_after_its_checkpoint(tmp_path):
    trial = tmp_path / "trial"
    cfg = cfg_with(tensorboard=True)
    write_steps(trial, cfg, range(1, 5))
    write_steps(trial, cfg, range(3, 6), resume_step=2)  # steps 3 and 4 redone
    board = tensorboard_scalars(trial / "tensorboard")
    assert [s for s, _ in board["actor_train/loss"]] == [1, 2, 3, 4, 5]
    assert read_log(trial).stat_series()["actor_train/loss"][0].tolist() == [1, 2, 3, 4, 5]


def test_no_dashboards_unless_asked_and_bad_values_refused(tmp_path):
    assert dashboards.open_dashboards(cfg_with(), tmp_path) is None
    assert not (tmp_path / "tensorboard").exists()
    with pytest.raises(Exception, match="dashboards.wandb: 'yes' must be one of off, offline, online"):
        cfg_with(wandb="yes")


def test_wandb_offline_writes_its_run_files(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trial = tmp_path / "trial"
    write_steps(trial, cfg_with(wandb="offline"), range(1, 3))
    runs = list((trial / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert [p.stat().st_size > 0 for p in runs[0].glob("*.wandb")] == [True]
