"""SIGINT or SIGTERM to `restage run` alone (not its process group) reaches every rank: the first checkpoints at
the end of the step and stops with the log closed; a second stops at once; a killed launcher takes its ranks along."""

import signal
import time

import psutil
import pytest
from runs import last_checkpoint, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=200", "run.save_every=0"]


def _start(tmp_path, trial):
    run = restage_run(tmp_path, *JOB, f"trial={trial}", wait=False)
    lines, deadline = [], time.monotonic() + 240
    for line in run.stdout:  # until the ranks are well into the run
        lines.append(line)
        if line.startswith("step 1/") or time.monotonic() > deadline:
            break
    assert lines and lines[-1].startswith("step 1/"), "".join(lines[-30:])
    return run, tmp_path / "ppo-tiny" / trial


def _ranks_of(trial) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if ("restage.runtime.spmd" in cmd or "prterun" in cmd or "mpirun" in cmd) and str(trial) in cmd:
            found.append(proc)
    return found


def _finish(run, timeout_seconds):
    started = time.monotonic()
    output, _ = run.communicate(timeout=timeout_seconds)
    return output, time.monotonic() - started


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_one_signal_checkpoints_at_the_step_end_and_stops(tmp_path, signum):
    run, trial = _start(tmp_path, signum.name)
    run.send_signal(signum)
    output, seconds = _finish(run, 120)
    assert seconds < 60, output[-2000:]
    assert run.returncode == 128 + signum, output[-2000:]
    assert output.strip().splitlines()[-1] == (f"restage: stopped on {signum.name} after checkpointing at the end "
                                               f"of its step: {trial}")
    log = read_log(trial)
    # The master checks for the request right after printing a step's line, so a signal sent on seeing "step 1/"
    # may still stop at the end of that step on a loaded machine.
    assert log.closed and 1 <= log.last_complete_step < 200
    assert last_checkpoint(trial).name == f"step-{log.last_complete_step}"  # one step numbering: from 1
    assert not (trial / "PREEMPT").exists() and _ranks_of(trial) == []


def test_a_second_signal_stops_at_once(tmp_path):
    run, trial = _start(tmp_path, "twice")
    run.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    run.send_signal(signal.SIGTERM)
    output, seconds = _finish(run, 120)
    assert seconds < 30 and run.returncode == 143, output[-2000:]
    assert output.strip().splitlines()[-1].startswith("restage: stopped on SIGTERM at once, without a checkpoint")
    assert _ranks_of(trial) == []


def test_the_ranks_die_with_a_killed_launcher(tmp_path):
    run, trial = _start(tmp_path, "killed")
    assert _ranks_of(trial)
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while _ranks_of(trial) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _ranks_of(trial) == []
