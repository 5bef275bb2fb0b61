"""Time limits on rule rewards (rewards.timeout_seconds, batch_timeout_seconds): the killable worker processes
(algorithms/timelimit.py) and what a batch scores when a call does not return (algorithms/scoring.py)."""

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import hanging_reward
import pytest

from restage.algorithms.rewards import resolve_reward
from restage.algorithms.scoring import RewardPool, score
from restage.algorithms.timelimit import TimeLimitedWorkers, TimeLimitExceeded, WorkerDied
from restage.config.load import config_from_dict
from restage.config.sections import RewardsConfig
from restage.errors import ConfigError, RewardError

PROMPTS = ["p0", "p1", "p2", "p3"]
ANSWERS = ["ab", "xyz", "abcd", "x"]  # answers 1 and 3 hang under hangs_on_x
IDS = [10, 11, 12, 13]


def test_a_call_past_its_limit_raises_within_it_and_its_worker_is_killed_and_replaced():
    with TimeLimitedWorkers(1) as workers:
        assert workers.call(divmod, (7, 2), timeout_seconds=5) == (3, 1)
        pid = next(iter(workers._idle)).process.pid
        began = time.monotonic()
        with pytest.raises(TimeLimitExceeded, match="did not return within 0.5 s"):
            workers.call(hanging_reward.forever, ([], []), timeout_seconds=0.5)
        assert 0.5 <= time.monotonic() - began < 2.0
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed (and reaped)
        assert workers.started == 0
        assert workers.call(hanging_reward.length, (["p"], ["abc"]), timeout_seconds=5) == [3.0]
        assert workers.started == 1


def test_what_a_call_raises_is_raised_and_a_call_that_cannot_be_sent_or_kills_its_worker_says_so():
    with TimeLimitedWorkers(1) as workers:
        with pytest.raises(ValueError, match="invalid literal"):
            workers.call(int, ("x",))
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            workers.call(lambda: 1)
        with pytest.raises(WorkerDied, match="exit code 3"):
            workers.call(hanging_reward.exits, ([], []))
        assert workers.call(sum, ([1, 2],)) == 3


def test_per_sample_answers_that_hang_score_the_timeout_score_with_one_line_naming_reward_and_samples(capfd):
    options = RewardsConfig(workers=2, timeout_seconds=0.5, timeout_score=-1.0)
    began = time.monotonic()
    with RewardPool(options.workers) as pool:
        pending = pool.submit(hanging_reward.hangs_on_x, PROMPTS, ANSWERS, IDS, None, options)
        assert pending.result() == [2.0, -1.0, 4.0, -1.0]
        assert pending.timed_out() == 2
    assert time.monotonic() - began < 0.5 + 5.0  # two hangs side by side on two workers, plus start-up
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith("restage:")]
    assert lines == ["restage: reward hangs_on_x: samples 11, 13 did not return within rewards.timeout_seconds=0.5 "
                     "(2 of 4 answers); scored -1 (rewards.on_timeout=stop stops the run instead)"]


def test_a_batched_reward_that_hangs_times_out_as_a_whole_and_on_timeout_stop_raises_one_line():
    options = RewardsConfig(workers=1, timeout_seconds=0.5)
    with RewardPool(1) as pool:
        pending = pool.submit(hanging_reward.forever, PROMPTS[:1], ANSWERS[:1], IDS[:1], None, options)
        assert pending.result() == [0.0] and pending.timed_out() == 1
    stop = RewardsConfig(workers=1, timeout_seconds=0.5, on_timeout="stop")
    with pytest.raises(RewardError) as err:
        score(hanging_reward.forever, PROMPTS[:1], ANSWERS[:1], IDS[:1], None, stop)
    assert str(err.value) == ("reward forever: sample 10 did not return within rewards.timeout_seconds=0.5 (1 of 1 "
                              "answers); fix the reward or raise the limit (or set rewards.on_timeout=score to score "
                              "such answers rewards.timeout_score)")


def test_the_batch_limit_ends_the_answers_still_running_or_waiting_when_it_passes(capfd):
    options = RewardsConfig(workers=1, batch_timeout_seconds=2.0)
    fields = {i: {"seconds": s} for i, s in zip(IDS, (0.0, 0.0, 30.0, 0.0))}
    began = time.monotonic()
    with RewardPool(1) as pool:
        pending = pool.submit(hanging_reward.sleeps, PROMPTS, ANSWERS, IDS, fields, options)
        assert pending.result() == [1.0, 1.0, 0.0, 0.0]  # the third ran into the limit; the fourth never started
        assert pending.timed_out() == 2
    assert 2.0 <= time.monotonic() - began < 6.0
    assert ("restage: reward sleeps: samples 12, 13 did not return within rewards.batch_timeout_seconds=2 (2 of 4 "
            "answers); scored 0") in capfd.readouterr().err


def test_scores_under_a_limit_equal_those_without_one_for_batched_functions_and_rebuilt_verifiers():
    answers = ["ab", "abc", "zz", "a"]
    plain = RewardsConfig(workers=2, format_pattern="a.*")
    timed = RewardsConfig(workers=2, format_pattern="a.*", timeout_seconds=5.0)
    for fn_plain, fn_timed in ((hanging_reward.length, hanging_reward.length),
                               (resolve_reward("format", plain), resolve_reward("format", timed))):
        expected = score(fn_plain, PROMPTS, answers, IDS, None, plain)
        assert score(fn_timed, PROMPTS, answers, IDS, None, timed) == expected
    assert score(resolve_reward("format", timed), PROMPTS, answers, IDS, None, timed) == [1.0, 1.0, 0.0, 1.0]


def test_a_reward_a_worker_cannot_import_is_refused_in_one_line_and_bad_options_too():
    with pytest.raises(ConfigError, match=r"reward_fn .*<lambda>: a time limit .* define it at the top level"):
        score(lambda p, a: [0.0] * len(a), PROMPTS, ANSWERS, IDS, None, RewardsConfig(timeout_seconds=1.0))
    base = {"experiment": "x", "algorithm": "grpo", "reward_fn": "sort", "models": {"actor": {"path": "m"}}}
    for rewards, key in (({"on_timeout": "zero"}, "rewards.on_timeout"), ({"timeout_seconds": -1}, "timeout_seconds"),
                         ({"timeout_score": float("nan")}, "rewards.timeout_score")):
        with pytest.raises(ConfigError, match=key):
            config_from_dict({**base, "rewards": rewards})


def test_a_worker_in_a_call_that_never_returns_exits_when_its_parent_dies():
    script = f"""
import os, sys, threading, time
sys.path.insert(0, {str(Path(hanging_reward.__file__).parent)!r})
import hanging_reward
from restage.algorithms.timelimit import TimeLimitedWorkers
workers = TimeLimitedWorkers(1)
threading.Thread(target=workers.call, args=(hanging_reward.forever, ([], [])), daemon=True).start()
while not workers._busy or not workers._busy.copy().pop().loaded:
    time.sleep(0.05)
print(workers._busy.copy().pop().process.pid, flush=True)
os._exit(0)  # as a rank killed mid-step: no close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
