"""LogWriter / read_log: round trip, format version, resume, misuse, crashed logs."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from restage.cli import main as restage_main
from restage.errors import LogError
from restage.report.log import FORMAT_VERSION, read_log
from restage.report.log_writer import LogWriter
from restage.report.summary import format_text, summarize


def write_steps(writer: LogWriter, steps, scale: float = 1.0) -> None:
    """Two ranks, one MFC each plus a reallocation and statistics per step (steps count from 1); ``scale`` changes
    every value."""
    for step in steps:
        t0 = 100.0 * step
        for rank in (0, 1):
            writer.mfc(step, "actor_train", "actor", "train_step", rank, t0 + 0.1, t0 + 0.1 + scale, 10 * step, 1e9 * scale, 2**30)
        writer.realloc(step, "actor", "[0-1]dp2tp1pp1", "[0-1]dp1tp2pp1", int(1e6 * scale), t0, t0 + 0.1)
        writer.stats(step, {"loss": scale / step} | ({"kl": 0.1 * step} if step >= 3 else {}))
        writer.end_step(step, t0, t0 + 2 * scale, samples=4, tokens=40, flops=2e9 * scale)


def test_round_trip(tmp_path):
    with LogWriter(tmp_path / "run", world_size=2, config="a: 1\n", schedule={"mfcs": []}, cluster={"x": 1},
                   versions={"torch": "9"}, dtype="bf16") as writer:
        write_steps(writer, range(1, 5))
    log = read_log(tmp_path / "run")
    assert log.path == tmp_path / "run" / "log.h5"
    assert (log.format_version, log.world_size, log.dtype, log.closed) == (FORMAT_VERSION, 2, "bf16", True)
    assert (log.config, log.schedule, log.cluster, log.versions) == ("a: 1\n", {"mfcs": []}, {"x": 1}, {"torch": "9"})
    assert log.steps["step"].tolist() == [1, 2, 3, 4] and log.steps["end_seconds"].tolist() == [102.0, 202.0, 302.0, 402.0]
    assert log.mfcs["rank"].tolist() == [0, 1] * 4 and set(log.mfcs["name"].tolist()) == {"actor_train"}
    assert log.mfcs["tokens"].tolist() == [10, 10, 20, 20, 30, 30, 40, 40]
    assert log.transfers["kind"].tolist() == ["realloc"] * 4 and log.transfers["rank"].tolist() == [-1] * 4
    assert log.transfers["dst"][0] == "[0-1]dp1tp2pp1" and log.transfers["num_bytes"][0] == 1_000_000
    series = log.stat_series()
    assert series["loss"][0].tolist() == [1, 2, 3, 4] and series["loss"][1].tolist() == [1.0, 0.5, 1 / 3, 0.25]
    assert series["kl"][0].tolist() == [3, 4]  # a statistic that first appears at step 3


def test_another_format_version_is_refused_in_one_line(tmp_path, capsys):
    with LogWriter(tmp_path / "log.h5", world_size=1) as writer:
        write_steps(writer, range(1, 2))
    with h5py.File(tmp_path / "log.h5", "a") as f:
        f.attrs["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(LogError, match=f"format version {FORMAT_VERSION + 1}, this restage reads versions 1, 2"):
        read_log(tmp_path)
    assert restage_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("restage: error: ") and "format version" in err
    with pytest.raises(LogError, match="format version"):
        LogWriter(tmp_path, world_size=1, resume_step=0)


def test_missing_log_and_no_step_are_one_line_errors(tmp_path, capsys):
    assert restage_main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no log.h5 at" in capsys.readouterr().err
    LogWriter(tmp_path, world_size=1).close()
    assert restage_main(["report", str(tmp_path)]) == 2
    assert "has no complete step" in capsys.readouterr().err


def test_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    with LogWriter(tmp_path / "a", world_size=2) as writer:
        write_steps(writer, range(1, 6))  # steps 4 and 5 ran after the checkpoint step-3, then the job died
    with LogWriter(tmp_path / "a", world_size=2, resume_step=3) as writer:
        assert writer.last_complete_step == 3
        write_steps(writer, range(4, 6), scale=3.0)
    with LogWriter(tmp_path / "b", world_size=2) as writer:  # the same run, straight through
        write_steps(writer, range(1, 4))
        write_steps(writer, range(4, 6), scale=3.0)
    resumed, straight = read_log(tmp_path / "a"), read_log(tmp_path / "b")
    for name in ("steps", "mfcs", "transfers", "stats"):
        assert np.array_equal(getattr(resumed, name), getattr(straight, name)), name
    assert resumed.resumed_at_steps == [3] and resumed.closed


def test_misuse_is_refused(tmp_path):
    writer = LogWriter(tmp_path, world_size=1)
    with pytest.raises(ValueError, match="steps count from 1"):
        writer.stats(0, {"loss": 1.0})
    write_steps(writer, range(1, 3))
    with pytest.raises(ValueError, match="already complete"):
        writer.stats(2, {"loss": 1.0})
    writer.mfc(4, "actor_train", "actor", "train_step", 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="rows of steps \\[4\\] recorded while closing step 3"):
        writer.end_step(3, 0.0, 1.0, 1, 1)
    writer.close()
    with pytest.raises(LogError, match="already exists"):
        LogWriter(tmp_path, world_size=1)


def test_a_run_that_raised_is_reported_up_to_its_last_complete_step(tmp_path):
    with pytest.raises(RuntimeError), LogWriter(tmp_path, world_size=2) as writer:
        write_steps(writer, range(1, 4))
        writer.mfc(4, "actor_train", "actor", "train_step", 0, 400.0, 401.0)
        raise RuntimeError("an MFC failed")
    log = read_log(tmp_path)
    assert not log.closed and log.last_complete_step == 3 and log.steps["step"].tolist() == [1, 2, 3]
    text = format_text(summarize(log))
    assert "log not closed (the run crashed or is still running): reported up to its last complete step 3" in text


def test_rows_of_the_step_in_flight_are_dropped(tmp_path):
    """A kill inside end_step's flush window leaves rows of a step that is not marked complete."""
    with LogWriter(tmp_path, world_size=2) as writer:
        write_steps(writer, range(1, 3))
    with h5py.File(tmp_path / "log.h5", "a") as f:
        rows = f["mfcs"][:2]
        rows["step"] = 3
        f["mfcs"].resize((6,))
        f["mfcs"][4:] = rows
        f.attrs["closed"] = False
    log = read_log(tmp_path)
    assert log.dropped_rows == 2 and log.mfcs["step"].max() == 2
    assert "2 rows of the step in flight dropped" in summarize(log)["status"]


def test_a_live_log_reads_while_the_writer_holds_it(tmp_path):
    writer = LogWriter(tmp_path, world_size=2)
    write_steps(writer, range(1, 3))
    writer.stats(3, {"loss": 0.1})  # step 3 in flight: recorded, not written
    log = read_log(tmp_path)
    assert not log.closed and log.last_complete_step == 2 and len(log.stats) == 2
    write_steps(writer, range(3, 4))
    assert read_log(tmp_path).last_complete_step == 3
    writer.close()
    assert read_log(tmp_path).closed


def test_a_log_with_step_rows_only_is_reported(tmp_path):
    from restage.report.plots import write_plots

    with LogWriter(tmp_path, world_size=1) as writer:
        for step in range(1, 4):
            writer.end_step(step, 10.0 * step, 10.0 * step + 2.0, samples=8, tokens=80)
    log = read_log(tmp_path)
    summary = summarize(log)
    assert summary["throughput"]["all"]["tokens_per_second"] == pytest.approx(240 / 6.0)
    assert summary["mfcs"] == [] and summary["shares"]["0"]["idle"] == pytest.approx(1.0)
    assert "no per-MFC predictions" in summary["warnings"][0] and "MFU skipped" in summary["warnings"][1]
    assert [p.name for p in write_plots(log, summary, tmp_path / "png")] == ["timeline.png", "throughput.png"]
    assert "reported up to" not in format_text(summary)


def test_a_version_1_log_counted_from_0_reads_from_1_and_is_upgraded_on_resume(tmp_path):
    """Format 1 logged the Nth completed step as N - 1; the reader and a resumed writer renumber it."""
    with LogWriter(tmp_path / "a", world_size=2) as writer:
        write_steps(writer, range(1, 4))
    expected = read_log(tmp_path / "a")
    with h5py.File(tmp_path / "a" / "log.h5", "a") as f:  # as format 1 wrote it
        for name in ("steps", "mfcs", "transfers", "stats"):
            rows = f[name][:]
            rows["step"] -= 1
            f[name][:] = rows
        f.attrs["format_version"], f.attrs["last_complete_step"], f.attrs["resumed_at_steps"] = 1, 2, "[0]"
    old = read_log(tmp_path / "a")
    assert old.format_version == 1 and old.last_complete_step == 3 and old.resumed_at_steps == [1]
    for name in ("steps", "mfcs", "transfers", "stats"):
        assert np.array_equal(getattr(old, name), getattr(expected, name)), name
    with LogWriter(tmp_path / "a", world_size=2, resume_step=2) as writer:  # resumed from checkpoint step-2
        write_steps(writer, range(3, 4))
    upgraded = read_log(tmp_path / "a")
    assert (upgraded.format_version, upgraded.resumed_at_steps) == (FORMAT_VERSION, [1, 2])
    assert upgraded.steps["step"].tolist() == [1, 2, 3] and np.array_equal(upgraded.stats, expected.stats)
