"""A full disk, or a torn file, while the log is written: the earlier steps stay readable, the error is one line."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from restage.cli import main as restage_main
from restage.errors import DiskFullError, LogError
from restage.report import journal
from restage.report.log import read_log
from restage.report.log_writer import LogWriter

RANKS, MFCS = 8, 6


def write_step(writer: LogWriter, step: int) -> None:
    """The rows of log step ``step`` (steps count from 1)."""
    for mfc in range(MFCS):
        for rank in range(RANKS):
            writer.mfc(step, f"mfc{mfc}", "actor", "inference", rank, step + 0.1, step + 0.5, 100, 1e12, 2**30)
    writer.realloc(step, "actor", "[0-7]dp8tp1pp1", "[0-7]dp1tp8pp1", 2**20, step + 0.5, step + 0.6)
    writer.stats(step, {"loss": 1.0 / (step + 1), "reward": float(step)})
    writer.end_step(step, float(step), step + 1.0, 8, 64, 1e13)


def assert_steps_intact(path, steps: int) -> None:
    """Every row of steps 1..steps, as ``write_step`` wrote them, and nothing else."""
    log = read_log(path)
    assert log.last_complete_step == steps and not log.closed
    assert log.steps["step"].tolist() == list(range(1, steps + 1))
    assert log.mfcs["step"].tolist() == [s for s in range(1, steps + 1) for _ in range(MFCS * RANKS)]
    assert np.allclose(log.mfcs["end_seconds"], log.mfcs["step"] + 0.5)
    assert log.transfers["step"].tolist() == list(range(1, steps + 1))
    assert log.stat_series()["loss"][1].tolist() == [1.0 / (s + 1) for s in range(1, steps + 1)]


def test_a_tmpfs_filling_during_the_log_write_keeps_every_earlier_step(small_tmpfs, capsys):
    disk = small_tmpfs(64 * 1024)
    writer = LogWriter(disk / "run", world_size=RANKS)
    done = 0
    with pytest.raises(DiskFullError) as caught:
        while done < 1000:
            write_step(writer, done + 1)
            done += 1
    writer.abort()
    assert 3 < done < 1000  # filled mid-run: some steps written, then no room for the next line
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"no space left on {disk} (tmpfs) while writing the run log (step {done + 1})")
    assert_steps_intact(disk / "run", done)
    assert journal.journal_path(disk / "run" / "log.h5").read_bytes().endswith(b"\n")  # cut back to a whole line
    assert restage_main(["report", str(disk / "run")]) == 0
    assert f"reported up to its last complete step {done}" in capsys.readouterr().out


def test_a_full_disk_when_closing_keeps_the_journal(small_tmpfs):
    """close() rewrites log.h5 with every step: with no room for that copy, the log stays as it was."""
    disk = small_tmpfs(128 * 1024)
    writer = LogWriter(disk / "run", world_size=RANKS)
    done = 0
    filler = disk / "filler"
    while journal.journal_path(writer.path).stat().st_size < 32 * 1024:
        write_step(writer, done + 1)
        done += 1
    with open(filler, "wb") as handle:  # leave a few KiB: less than the closed log.h5 needs
        handle.write(b"\0" * (os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize - 8 * 1024))
    with pytest.raises(DiskFullError, match=f"no space left on {disk} \\(tmpfs\\) while writing the run log "
                                            "\\(folding its journal into log.h5\\)"):
        writer.close()
    assert_steps_intact(disk / "run", done)
    assert not list((disk / "run").glob(".*.tmp"))  # the half-written copy is removed


@pytest.mark.parametrize("fail_at", [0, 3])
def test_enospc_at_a_chosen_step_write(tmp_path, monkeypatch, fail_at):
    """The write of step ``fail_at + 1`` gets half its line out, then ENOSPC: the journal is cut back to step fail_at."""
    writer = LogWriter(tmp_path, world_size=RANKS)
    real_write = os.write

    def failing_write(fd, data):  # patched in just before step fail_at
        real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    for step in range(1, fail_at + 1):
        write_step(writer, step)
    size = journal.journal_path(writer.path).stat().st_size
    monkeypatch.setattr(journal.os, "write", failing_write)
    with pytest.raises(DiskFullError, match=f"while writing the run log \\(step {fail_at + 1}\\)"):
        for step in range(fail_at + 1, fail_at + 3):
            write_step(writer, step)
    monkeypatch.undo()
    assert journal.journal_path(writer.path).stat().st_size == size
    assert writer.last_complete_step == fail_at
    if fail_at:
        assert_steps_intact(tmp_path, fail_at)
    else:
        assert read_log(tmp_path).last_complete_step == 0
    writer.abort()


def test_a_torn_or_corrupt_journal_line_ends_what_is_read(tmp_path):
    writer = LogWriter(tmp_path, world_size=RANKS)
    for step in range(1, 5):
        write_step(writer, step)
    writer.abort()
    path = journal.journal_path(writer.path)
    whole = path.read_bytes()
    path.write_bytes(whole + b'1234abcd {"step": 5, "st')  # a kill inside the write of step 5
    assert_steps_intact(tmp_path, 4)
    lines = whole.split(b"\n")
    lines[3] = lines[3].replace(b'"step":3', b'"step":7')  # a flipped byte in step 3's line: its CRC fails
    path.write_bytes(b"\n".join(lines))
    assert_steps_intact(tmp_path, 2)


def test_a_journal_of_a_replaced_log_is_ignored(tmp_path):
    with LogWriter(tmp_path, world_size=RANKS) as writer:
        write_step(writer, 1)
    stale = journal.journal_path(writer.path)
    stale.write_bytes(b"restage-log-journal 0123456789abcdef\n")  # left by an earlier run's crash
    writer = LogWriter(tmp_path, world_size=RANKS, overwrite=True)
    write_step(writer, 1)
    writer.abort()
    assert_steps_intact(tmp_path, 1)


def test_a_torn_hdf5_file_is_a_one_line_error(tmp_path, capsys):
    """A version 1 log torn in place (what a kill or a full disk did to it) is refused in one line, not an OSError."""
    with LogWriter(tmp_path, world_size=RANKS) as writer:
        for step in range(1, 4):
            write_step(writer, step)
    data = writer.path.read_bytes()
    writer.path.write_bytes(data[: len(data) // 2])
    with pytest.raises(LogError, match="is not a readable restage log"):
        read_log(tmp_path)
    assert restage_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("restage: error: ") and "not a readable restage log" in err
