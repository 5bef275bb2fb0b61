"""The launcher's watchdog over the ranks' heartbeat files: who is stopped, who the others wait on, start-up lines."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace

from restage.launch.watchdog import Limits, Watchdog
from restage.runtime.control.heartbeat import STARTUP_PHASES, Beat, Heartbeat, beat_path, heartbeat_dir, read_beat

LIMITS = Limits(startup_seconds=100.0, collective_seconds=30.0, wait_seconds=40.0)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _beat(rank: int, **changes) -> Beat:
    base = Beat(rank=rank, host="node-a", pid=100 + rank, beat=1, activity="step 3: run actor_train", waiting=False,
                startup=False, activity_seconds=0.0, phase=len(STARTUP_PHASES) - 1)
    return replace(base, **changes)


def _write(trial, beat: Beat) -> None:
    path = beat_path(heartbeat_dir(trial), beat.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(beat)))


def _dog(trial, world_size=2, state=lambda beat: "S"):
    clock, said = Clock(), []
    return Watchdog(trial, world_size, LIMITS, clock=clock, say=said.append, state=state), clock, said


def test_a_rank_whose_beat_stops_is_named_with_its_host_and_activity(tmp_path):
    dog, clock, _ = _dog(tmp_path, state=lambda beat: "T" if beat.rank == 1 else "S")
    _write(tmp_path, _beat(0, activity="step 3: waiting for every rank's end of the step", waiting=True))
    _write(tmp_path, _beat(1, activity="step 3: run actor_train"))
    assert dog.check() is None
    for beat in range(2, 18):  # rank 0 beats every second; rank 1 is stopped
        clock.now += 1.0
        _write(tmp_path, _beat(0, beat=beat, activity="step 3: waiting for every rank's end of the step",
                               waiting=True, activity_seconds=beat - 1.0))
        line = dog.check()
        if clock.now - 1000.0 <= 15.0:
            assert line is None, line
        else:
            break
    assert line == ("rank 1 on node-a (pid 101) is stopped (SIGSTOP or a debugger): no heartbeat for 16 s "
                    "(half of run.collective_timeout_seconds=30); it was last seen in step 3: run actor_train")


def test_a_silent_rank_whose_process_is_gone_is_left_to_mpirun(tmp_path):
    dog, clock, _ = _dog(tmp_path, state=lambda beat: "gone")
    _write(tmp_path, _beat(0))
    _write(tmp_path, _beat(1))
    dog.check()
    clock.now += 60.0
    assert dog.check() is None


def test_a_rank_others_wait_on_past_their_timeout_is_named_while_its_heartbeat_runs(tmp_path):
    dog, clock, _ = _dog(tmp_path)
    for beat in range(1, 43):
        _write(tmp_path, _beat(0, beat=beat, activity="step 2: transfer rewards reward_inf -> actor_train",
                               waiting=True, activity_seconds=float(beat)))
        _write(tmp_path, _beat(1, beat=beat, activity="step 2: run reward_inf", activity_seconds=float(beat + 5)))
        line = dog.check()
        if beat <= 40:
            assert line is None, line
        clock.now += 1.0
    assert line == ("rank 1 on node-a (pid 101) was still in step 2: run reward_inf after 47 s while rank(s) 0 waited "
                    "for it beyond run.peer_wait_timeout_seconds=40 (rank 0: step 2: transfer rewards reward_inf -> "
                    "actor_train)")


def test_ranks_that_all_wait_are_a_deadlock_named_by_the_longest_waiter(tmp_path):
    dog, _, _ = _dog(tmp_path)
    _write(tmp_path, _beat(0, activity="step 4: waiting for every rank's end of the step", waiting=True,
                           activity_seconds=41.0))
    _write(tmp_path, _beat(1, activity="step 4: transfer values critic_inf -> actor_train", waiting=True,
                           activity_seconds=30.0))
    assert dog.check() == ("rank 0 on node-a (pid 100) waited beyond run.peer_wait_timeout_seconds=40 (41 s) in "
                           "step 4: waiting for every rank's end of the step; every rank was waiting (rank 1: step 4: "
                           "transfer values critic_inf -> actor_train)")


def test_start_up_has_its_own_timeout_and_names_what_the_rank_waits_for(tmp_path):
    dog, _, _ = _dog(tmp_path)
    waiting_for = "start-up: waiting for pid 4242 on node-a, which holds restage's build lock of cpu_adam"
    _write(tmp_path, _beat(0, activity=waiting_for, waiting=True, startup=True, activity_seconds=101.0, phase=0))
    _write(tmp_path, _beat(1, activity="start-up: waiting for this node's build of cpu_adam", waiting=True,
                           startup=True, activity_seconds=100.5, phase=0))
    line = dog.check()
    assert line.startswith(f"rank 0 on node-a (pid 100) waited beyond run.startup_timeout_seconds=100 (101 s) in "
                           f"{waiting_for}")
    building = _dog(tmp_path)[0]
    _write(tmp_path, _beat(0, activity="start-up: loading (building if needed) DeepSpeed's cpu_adam op",
                           startup=True, activity_seconds=120.0, phase=0))
    assert building.check() == ("rank 0 on node-a (pid 100) exceeded run.startup_timeout_seconds=100: 120 s in "
                                "start-up: loading (building if needed) DeepSpeed's cpu_adam op")


def test_a_rank_that_never_writes_a_heartbeat_is_reported_after_the_start_up_timeout(tmp_path):
    dog, clock, _ = _dog(tmp_path)
    _write(tmp_path, _beat(0, startup=True, phase=-1, activity="start-up: waiting for every rank to join "
                           "torch.distributed", waiting=True))
    clock.now += 99.0
    _write(tmp_path, _beat(0, beat=2, startup=True, phase=-1, activity="start-up: importing", activity_seconds=1.0))
    assert dog.check() is None
    clock.now += 2.0
    _write(tmp_path, _beat(0, beat=3, startup=True, phase=-1, activity="start-up: importing", activity_seconds=2.0))
    assert dog.check() == ("rank(s) 1 never started: no heartbeat within run.startup_timeout_seconds=100 of the "
                           "launch")


def test_one_line_per_start_up_phase_once_every_rank_passed_it(tmp_path):
    dog, clock, said = _dog(tmp_path)
    _write(tmp_path, _beat(0, startup=True, phase=1))
    dog.check()
    assert said == []  # rank 1 has not started
    clock.now += 2.5
    _write(tmp_path, _beat(1, startup=True, phase=0))
    dog.check()
    assert said == ["restage: start-up: all 2 ranks running (2.5 s)", "restage: start-up: ranks up on all 2 ranks (2.5 s)"]
    clock.now += 31.0
    dog.check()  # nothing new for 30 s: who is furthest behind
    assert said[-1] == ("restage: start-up: 34 s; 1 of 2 rank(s) still before 'compiled ops ready' "
                        "(rank 1: step 3: run actor_train)")
    _write(tmp_path, _beat(1, startup=True, phase=len(STARTUP_PHASES) - 2))
    _write(tmp_path, _beat(0, startup=True, phase=len(STARTUP_PHASES) - 2))
    dog.check()
    assert said[-4:] == [f"restage: start-up: {phase} on all 2 ranks (33.5 s)" for phase in STARTUP_PHASES[1:-1]]
    _write(tmp_path, _beat(1, startup=False, phase=len(STARTUP_PHASES) - 1))
    _write(tmp_path, _beat(0, startup=False, phase=len(STARTUP_PHASES) - 1))
    clock.now += 60.0
    dog.check()
    assert len(said) == 7  # "ready" is rank 0's to say; nothing more once the steps run


def test_the_rank_side_heartbeat_beats_names_its_activity_and_phase(tmp_path):
    heartbeat = Heartbeat(heartbeat_dir(tmp_path), rank=3, interval_seconds=0.05).start()
    heartbeat.doing("start-up: loading actor (/models/tiny)")
    heartbeat.reached("ranks up")
    first = read_beat(beat_path(heartbeat_dir(tmp_path), 3))
    assert (first.rank, first.activity, first.phase, first.startup, first.done) == (
        3, "start-up: loading actor (/models/tiny)", 0, True, False)
    time.sleep(0.6)  # a beat every interval, at most every MIN_WRITE_SECONDS (0.2 s)
    later = read_beat(beat_path(heartbeat_dir(tmp_path), 3))
    assert later.beat >= first.beat + 2 and later.activity_seconds >= 0.5
    heartbeat.reached("ready")
    heartbeat.interval_seconds = 60.0
    time.sleep(0.3)
    heartbeat.doing("step 1: run actor_gen")  # a change is written soon, not after the interval
    time.sleep(0.3)
    assert read_beat(beat_path(heartbeat_dir(tmp_path), 3)).activity == "step 1: run actor_gen"
    assert heartbeat.snapshot().startup is False
    heartbeat.finish()
    assert read_beat(beat_path(heartbeat_dir(tmp_path), 3)).done


def test_the_failure_line_puts_the_watchdog_first_and_names_the_busy_peer_of_a_timeout(tmp_path):
    from restage.runtime.control.failure import clear_failures, describe_failure, failure_dir, record_watchdog

    folder = failure_dir(tmp_path)
    folder.mkdir()
    (folder / "rank0.txt").write_text("RuntimeError: [gloo] Timed out waiting 16000ms for recv operation\n")
    _write(tmp_path, _beat(0, activity="step 3: run actor_train", activity_seconds=16.0))
    _write(tmp_path, _beat(1, activity="step 3: run actor_train", activity_seconds=40.0))
    assert describe_failure(tmp_path) == ("rank 0 failed: RuntimeError: [gloo] Timed out waiting 16000ms for recv "
                                          "operation; rank 1 on node-a was last seen in step 3: run actor_train (40 s)")
    record_watchdog(tmp_path, "rank 1 on node-a (pid 101) is stopped (SIGSTOP or a debugger): ...")
    assert describe_failure(tmp_path, "process rank 1 with PID 101 on node vm exited on signal 9") == (
        "rank 1 on node-a (pid 101) is stopped (SIGSTOP or a debugger): ...")
    clear_failures(tmp_path)
    assert list(folder.iterdir()) == []


def test_a_step_activity_past_its_bound_is_warned_of_once_with_no_peer_waiting_and_the_job_goes_on(tmp_path):
    clock, said = Clock(), []
    dog = Watchdog(tmp_path, 2, replace(LIMITS, activity_seconds=20.0), clock=clock, say=said.append,
                   state=lambda beat: "S")
    for beat in range(1, 31):  # both ranks beat every second: rank 0 in one generation, rank 1 in a long startup
        _write(tmp_path, _beat(0, beat=beat, activity="step 1: run actor_gen", activity_seconds=float(beat)))
        _write(tmp_path, _beat(1, beat=beat, activity="start-up: loading", startup=True, activity_seconds=float(beat)))
        assert dog.check() is None
        clock.now += 1.0
    warned = [line for line in said if line.startswith("restage: watchdog:")]
    assert warned == ["restage: watchdog: rank 0 on node-a (pid 100) has spent 21 s in step 1: run actor_gen, over "
                    "run.activity_timeout_seconds=20; still running (a reward that never returns? "
                    "rewards.timeout_seconds bounds one)"]
    # A new activity that runs long is warned of again; a wait (bounded by peer_wait_timeout_seconds) is not.
    for beat in range(31, 53):
        _write(tmp_path, _beat(0, beat=beat, activity="step 2: run actor_gen", activity_seconds=float(beat - 30)))
        _write(tmp_path, _beat(1, beat=beat, activity="step 2: waiting for every rank", waiting=True,
                               activity_seconds=float(beat - 30)))
        assert dog.check() is None
        clock.now += 1.0
    warned = [line for line in said if line.startswith("restage: watchdog:")]
    assert len(warned) == 2 and warned[1].startswith("restage: watchdog: rank 0 on node-a (pid 100) has spent 21 s in "
                                                 "step 2: run actor_gen")
    assert Limits.from_run(type("Run", (), {"startup_timeout_seconds": 1, "collective_timeout_seconds": 2,
                                            "peer_wait_timeout_seconds": 3, "activity_timeout_seconds": 4})
                           ).activity_seconds == 4
