"""describe_failure: the launcher's one line from the failure files and mpirun's output, whatever state they are in."""

from __future__ import annotations

import os
import time

from restage.report.log_writer import LogWriter
from restage.runtime.checkpoint.checkpoint_dir import begin, commit
from restage.runtime.control.failure import _record, describe_failure, failure_dir

FULL = ("DiskFullError: no space left on /scratch (tmpfs) while writing checkpoint step-4 (/scratch/t/checkpoints); "
        "free space there (or move run.results_dir) and --resume")


def test_an_empty_failure_file_does_not_mislead_the_launcher(tmp_path):
    """A disk that filled while the file was written left it empty: the rank's stderr line is used instead."""
    folder = failure_dir(tmp_path)
    folder.mkdir()
    (folder / "rank1.txt").write_text("")
    assert describe_failure(tmp_path, "noise\n[rank 1] ValueError: broke\nmore\n") == "rank 1 failed: ValueError: broke"
    assert describe_failure(tmp_path, "") == ("a rank exited abnormally without a recorded error "
                                              "(see the launcher output above)")


def test_a_full_disk_is_reported_as_itself_with_what_was_kept(tmp_path):
    with LogWriter(tmp_path, world_size=2) as writer:
        for step in range(1, 5):
            writer.end_step(step, 0.0, 1.0, 1, 1)
    begin(tmp_path, 2)
    commit(tmp_path, 2, {}, keep=5)
    folder = failure_dir(tmp_path)
    folder.mkdir()
    (folder / "rank0.txt").write_text("RuntimeError: Connection closed by peer\n")  # the echo, written first
    time.sleep(0.01)
    output = f"[rank 1] {FULL}\n"
    assert describe_failure(tmp_path, output) == (
        "no space left on /scratch (tmpfs) while writing checkpoint step-4 (/scratch/t/checkpoints); free space "
        "there (or move run.results_dir) and --resume (rank 1); kept: log steps 1..4, checkpoints step-2")


def test_a_failure_file_is_whole_or_absent(tmp_path, monkeypatch):
    path = failure_dir(tmp_path) / "rank0.txt"
    _record(path, "ValueError: x\ntraceback\n")
    assert path.read_text() == "ValueError: x\ntraceback\n"

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", no_room)
    _record(failure_dir(tmp_path) / "rank1.txt", "DiskFullError: no space\n")
    assert sorted(p.name for p in failure_dir(tmp_path).iterdir()) == ["rank0.txt"]
