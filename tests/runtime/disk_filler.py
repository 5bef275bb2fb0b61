"""A rule-based reward (all 0) that fills the trial's disk on one call of rank 0: the run's next write finds no room.

``RESTAGE_TEST_FILL_DIR``: where the filler file goes (on the disk to fill); ``RESTAGE_TEST_FILL_AT``: the call
that fills (each generating rank calls once per step, so call S is step S, counted from 1);
``RESTAGE_TEST_FILL_LEAVE_BYTES``: space left free; ``RESTAGE_TEST_FILL_STAMP``: a file (elsewhere) that gets
the time of the fill.
"""

import os
import time
from pathlib import Path

CALLS = {"n": 0}


def reward(prompts, answers):
    CALLS["n"] += 1
    if CALLS["n"] == int(os.environ["RESTAGE_TEST_FILL_AT"]) and os.environ.get("OMPI_COMM_WORLD_RANK") == "0":
        fill(Path(os.environ["RESTAGE_TEST_FILL_DIR"]), int(os.environ.get("RESTAGE_TEST_FILL_LEAVE_BYTES", "0")))
        Path(os.environ["RESTAGE_TEST_FILL_STAMP"]).write_text(repr(time.time()))
    return [0.0 for _ in prompts]


def fill(folder: Path, leave_bytes: int) -> None:
    stats = os.statvfs(folder)
    todo = stats.f_bavail * stats.f_frsize - leave_bytes
    chunk = b"\0" * (1 << 20)
    with open(folder / f"filler-{os.getpid()}", "wb", buffering=0) as handle:
        try:
            while todo > 0:
                todo -= handle.write(chunk[: min(len(chunk), todo)] if leave_bytes else chunk)
        except OSError:
            pass  # full: what leave_bytes=0 asks for
