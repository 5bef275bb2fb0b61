"""run_trial outside SLURM: the driver, mpirun, the rank bootstrap and the self-test on real processes."""

import threading
import time

import pytest
import yaml

from restage.errors import LogError
from restage.launch.job import TrialJob, run_trial
from restage.launch.trial import TrialPaths, read_json
from restage.report.log import read_log

pytestmark = pytest.mark.multirank


def by_hand(world_size, steps):
    return sum((rank + 1) * step for step in range(1, steps + 1) for rank in range(world_size))


def logged_steps(trial_dir):
    try:
        return [int(s) for s in read_log(trial_dir / "log.h5").steps["step"]]
    except (LogError, OSError, KeyError):
        return []


def config_dict(path):
    return yaml.safe_load(path.read_text())


def test_trial_runs_every_rank(write_config, tmp_path):
    cfg = config_dict(write_config(run={"steps": 4}))
    trial_dir = tmp_path / "results" / "launch" / "t"
    summary = run_trial(cfg, str(trial_dir))
    assert summary["world_size"] == 3
    result = read_json(trial_dir / "selftest.json")
    assert (result["world_size"], result["steps"], result["resumed_from"]) == (3, 4, None)
    assert result["sum_torch"] == result["sum_mpi"] == by_hand(3, 4) == 60
    assert [p["local_rank"] for p in result["placements"]] == [0, 1, 2]
    attempts = read_json(TrialPaths(trial_dir).job_record)["attempts"]
    assert [a["outcome"] for a in attempts] == ["completed"]
    assert "selftest: 3 ranks, 4 steps, sum 60" in (trial_dir / "output.log").read_text()
    assert (trial_dir / "config.yaml").is_file()


def test_preempt_checkpoints_and_resume_finishes_the_same_steps(write_config, tmp_path):
    steps = 25
    cfg = config_dict(write_config(run={"steps": steps}, algo={"selftest_sleep_seconds": 0.2},
                                   cluster={"devices_per_node": 2}))
    trial_dir = tmp_path / "results" / "launch" / "t"
    job = TrialJob()
    first = {}
    worker = threading.Thread(target=lambda: first.update(job(cfg, str(trial_dir))))
    worker.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(logged_steps(trial_dir)) < 3:
        time.sleep(0.2)
    resubmission = job.checkpoint(cfg, str(trial_dir))  # what submitit calls on the pre-timeout signal
    worker.join(60)
    assert first.get("preempted") is True
    stopped_at = logged_steps(trial_dir)[-1]
    assert 3 <= stopped_at < steps
    assert resubmission.kwargs == {"resume": True}
    resubmission.result()  # the requeued job
    result = read_json(trial_dir / "selftest.json")
    assert result["resumed_from"] == stopped_at
    assert result["steps"] == steps
    assert result["sum_torch"] == result["sum_mpi"] == by_hand(2, steps)
    assert logged_steps(trial_dir) == list(range(1, steps + 1))  # every step exactly once across the two attempts
    assert read_log(trial_dir / "log.h5").resumed_at_steps == [stopped_at]
    outcomes = [a["outcome"] for a in read_json(TrialPaths(trial_dir).job_record)["attempts"]]
    assert outcomes == [f"requeued after checkpoint at step {stopped_at}", "completed"]


def test_a_failing_rank_is_named_in_one_line(write_config, tmp_path):
    from restage.errors import LaunchError

    cfg = config_dict(write_config(cluster={"devices_per_node": 2}, algo={"selftest_fail_rank": 1, "selftest_fail_step": 2}))
    trial_dir = tmp_path / "results" / "launch" / "t"
    with pytest.raises(LaunchError) as err:
        run_trial(cfg, str(trial_dir))
    assert str(err.value) == f"{trial_dir}: rank 1 failed: RuntimeError: selftest failure injected at step 2"
    outcome = read_json(TrialPaths(trial_dir).job_record)["attempts"][-1]["outcome"]
    assert outcome.startswith("failed (") and outcome.endswith("rank 1 failed: RuntimeError: selftest failure injected at step 2")
