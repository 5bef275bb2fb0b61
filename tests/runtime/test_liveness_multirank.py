"""A rank that stops making progress ends the job within its timeout, in one line naming the rank, its host and
what it was doing: stopped (SIGSTOP) mid-run or during start-up, or stuck in an MFC while its heartbeat runs."""

import os
import re
import signal
import time

import pytest
from runs import last_checkpoint, rank_process, restage_run

from restage.report.log import read_log

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

TWO_LAYOUTS = ["-n", "2", "plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
               "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2",
               "plan.layouts.critic_train=ranks:0-1 dp2"]
JOB = ["jobs/ppo_tiny.yaml", "run.batch_size=8", "run.steps=200", *TWO_LAYOUTS]
COLLECTIVE_TIMEOUT_SECONDS = 16  # a stopped rank is named after half of it
# Silence (8 s), the heartbeat's interval (1.6 s), the watchdog's look (1 s), mpirun's teardown (SIGKILL after
# 10 s for a stopped rank), slack for a loaded machine.
STOPPED_BOUND_SECONDS = COLLECTIVE_TIMEOUT_SECONDS / 2 + 1.6 + 1 + 10 + 10


def _until(run, trial, ready, seconds=300):
    deadline = time.monotonic() + seconds
    while not ready():
        assert run.poll() is None and time.monotonic() < deadline, run.stdout.read()[-3000:]
        time.sleep(0.5)


def _stopped_line(rank: int, activity: str) -> re.Pattern:
    return re.compile(rf"restage: error: rank {rank} on \S+ \(pid \d+\) is stopped \(SIGSTOP or a debugger\): no "
                      rf"heartbeat for \d+ s \(half of run.collective_timeout_seconds={COLLECTIVE_TIMEOUT_SECONDS}\); "
                      rf"it was last seen in {activity}")


def _end(run, trial, since: float):
    output, _ = run.communicate(timeout=180)
    seconds = time.monotonic() - since
    assert run.returncode != 0, output[-3000:]
    assert rank_process(trial, 0) is None and rank_process(trial, 1) is None  # the stopped one too
    return output, seconds


def test_a_rank_stopped_mid_run_ends_the_job_naming_it_and_keeps_log_and_checkpoint(tmp_path):
    trial = tmp_path / "ppo-tiny" / "stopped"
    run = restage_run(tmp_path, *JOB, "run.save_every=2", f"run.collective_timeout_seconds={COLLECTIVE_TIMEOUT_SECONDS}",
                      "trial=stopped", wait=False)
    _until(run, trial, lambda: (trial / "log.h5").is_file() and (trial / "checkpoints").is_dir()
           and any((trial / "checkpoints").glob("step-*")) and read_log(trial).last_complete_step >= 3)
    victim = rank_process(trial, 1)
    stopped_at = time.monotonic()
    os.kill(victim.pid, signal.SIGSTOP)
    output, seconds = _end(run, trial, stopped_at)
    last = output.strip().splitlines()[-1]
    assert _stopped_line(1, r"step \d+: .+").fullmatch(last), output[-3000:]
    assert f"(pid {victim.pid})" in last
    assert seconds < STOPPED_BOUND_SECONDS, (seconds, output[-2000:])
    print(f"SIGSTOP of rank 1 mid-run: the launcher exited {seconds:.1f} s later: {last}")
    log = read_log(trial)
    assert log.last_complete_step >= 3 and len(log.steps) == log.last_complete_step
    assert (last_checkpoint(trial) / "manifest.json").is_file()


def test_a_rank_stopped_during_start_up_ends_the_job_naming_its_start_up_activity(tmp_path):
    trial = tmp_path / "ppo-tiny" / "stopped-early"
    run = restage_run(tmp_path, *JOB, f"run.collective_timeout_seconds={COLLECTIVE_TIMEOUT_SECONDS}",
                      "trial=stopped-early", wait=False)
    lines = []
    for line in run.stdout:  # until every rank has joined torch.distributed
        lines.append(line)
        if line.startswith("restage: start-up: ranks up on all 2 ranks"):
            break
    assert lines and lines[-1].startswith("restage: start-up: ranks up"), "".join(lines[-30:])
    victim = rank_process(trial, 1)
    stopped_at = time.monotonic()
    os.kill(victim.pid, signal.SIGSTOP)
    output, seconds = _end(run, trial, stopped_at)
    last = output.strip().splitlines()[-1]
    assert _stopped_line(1, "start-up: .+").fullmatch(last), output[-3000:]
    assert seconds < STOPPED_BOUND_SECONDS, (seconds, output[-2000:])
    print(f"SIGSTOP of rank 1 in start-up: the launcher exited {seconds:.1f} s later: {last}")
    assert not (trial / "checkpoints").is_dir() or not any((trial / "checkpoints").glob("step-*"))


def test_a_rank_stuck_in_an_mfc_with_its_heartbeat_running_is_named_by_what_the_others_wait_for(tmp_path):
    trial = tmp_path / "ppo-tiny" / "stuck"
    run = restage_run(tmp_path, *JOB, "run.peer_wait_timeout_seconds=20", "reward_fn=stuck_reward:reward",
                      "trial=stuck", wait=False)
    lines = []
    for line in run.stdout:
        lines.append(line)
        if line.startswith("step 2/"):
            break
    since = time.monotonic()  # rank 1 is stuck in the next step's generation from about now
    output, seconds = _end(run, trial, since)
    last = output.strip().splitlines()[-1]
    pattern = (r"restage: error: rank 1 on \S+ \(pid \d+\) was still in step 3: run actor_gen after \d+ s while "
               r"rank\(s\) 0 waited for it beyond run.peer_wait_timeout_seconds=20 \(rank 0: step 3: .+\)")
    assert re.fullmatch(pattern, last), "".join(lines[-5:]) + output[-3000:]
    assert seconds < 20 + 20, (seconds, output[-2000:])
    print(f"rank 1 stuck in step 3: the launcher exited {seconds:.1f} s after step 2's line: {last}")
    assert read_log(trial).last_complete_step == 2


@pytest.mark.scale  # about 75 s (it waits out a stale lock): make test's time bound
def test_a_jit_build_lock_left_by_a_dead_rank_is_reported_and_removed_and_the_run_goes_on(tmp_path):
    import shutil
    import socket
    import subprocess
    import sys

    from restage.runtime.store.deepspeed_ops import extensions_dir

    extensions = tmp_path / "torch_extensions"
    folder = extensions / "deepspeed_shm_comm"  # torch builds right under a TORCH_EXTENSIONS_DIR it is given
    built = extensions_dir() / "deepspeed_shm_comm"
    if built.is_dir():  # this machine's earlier build: no rebuild here
        shutil.copytree(built, folder, ignore=shutil.ignore_patterns("lock", "restage.*"))
    folder.mkdir(parents=True, exist_ok=True)
    dead_pid = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                                  text=True).stdout)
    (folder / "restage.holder").write_text(f"pid {dead_pid} on {socket.gethostname()}\n")  # a rank killed mid-build
    (folder / "lock").touch()
    done = restage_run(tmp_path, "jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=2", "trial=stale",
                       env={"TORCH_EXTENSIONS_DIR": str(extensions)}, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert (f"restage: removing {folder / 'lock'}: left by pid {dead_pid} on {socket.gethostname()}, which died "
            "while loading or building deepspeed_shm_comm") in output
    assert output.count("restage: removing ") == 1 and not (folder / "lock").exists()
    assert read_log(tmp_path / "ppo-tiny" / "stale").last_complete_step == 2
