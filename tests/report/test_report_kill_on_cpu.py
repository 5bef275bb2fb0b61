"""A writer SIGKILLed mid-step (or anywhere) leaves a log that reads up to its last complete step."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from restage.report.log import read_log
from restage.report.summary import summarize

RANKS, MFCS = 4, 3
CHILD = f"""
import sys, time
from restage.report.log_writer import LogWriter
path, pause = sys.argv[1], float(sys.argv[2])
writer = LogWriter(path, world_size={RANKS})
step = 1  # steps count from 1
print("started", flush=True)
while True:
    start = time.time()
    for mfc in range({MFCS}):
        for rank in range({RANKS}):
            writer.mfc(step, f"mfc{{mfc}}", "actor", "inference", rank, time.time(), time.time() + 0.001, 8, 1e6, 1000)
        time.sleep(pause)
    writer.realloc(step, "actor", "[0-3]dp4tp1pp1", "[0-3]dp1tp4pp1", 1000, start, time.time())
    writer.stats(step, {{"loss": 1.0 / step}})
    writer.end_step(step, start, time.time(), 4, 32, 0.0)
    print("step", step, flush=True)
    step += 1
"""


def start_writer(path, pause: float) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(pause)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "started"
    return proc


def check_consistent(path) -> int:
    log = read_log(path)
    complete = log.last_complete_step
    assert not log.closed
    assert log.steps["step"].tolist() == list(range(1, complete + 1))
    assert len(log.mfcs) == RANKS * MFCS * complete
    assert log.transfers["step"].tolist() == list(range(1, complete + 1))
    assert log.stat_series()["loss"][0].tolist() == list(range(1, complete + 1)) if complete >= 1 else True
    return complete


def test_sigkill_mid_step(tmp_path):
    proc = start_writer(tmp_path / "log.h5", pause=0.02)
    for expected in range(1, 5):
        assert proc.stdout.readline().split() == ["step", str(expected)]
    live = read_log(tmp_path / "log.h5")  # read while the writer still holds the file
    assert not live.closed and live.last_complete_step >= 4
    time.sleep(0.03)  # inside step 5: some of its MFC rows are recorded, none written
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = check_consistent(tmp_path / "log.h5")
    assert complete >= 4
    summary = summarize(read_log(tmp_path / "log.h5"))
    assert summary["crashed"] and summary["throughput"]["all"]["steps"] == complete
    assert summary["status"].endswith(f"reported up to its last complete step {complete}")


@pytest.mark.parametrize("trial", range(4))
def test_sigkill_at_a_random_moment_of_a_busy_writer(tmp_path, trial):
    """No pauses: the writer spends most of its time inside end_step, so kills land in the flush window too."""
    proc = start_writer(tmp_path / "log.h5", pause=0.0)
    time.sleep(random.Random(trial).uniform(0.05, 0.4))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert check_consistent(tmp_path / "log.h5") >= 0
