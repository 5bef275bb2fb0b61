"""The local one-node SLURM cluster (scripts/slurm_local.sh), started once per session; config writers;
the tiny model; and one uninterrupted real run that several tests read."""

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from slurm_jobs import REPO, SELFTEST, failure_report, reference_overrides, submit_real, wait_finished


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster():
    """Start (or check) the local cluster; skip only when not root and it cannot be started."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "slurm_local.sh"), "start"], capture_output=True, text=True)
    if done.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip(f"no local SLURM cluster (not root): {done.stderr.strip().splitlines()[-1:]}")
        raise RuntimeError(f"scripts/slurm_local.sh start failed:\n{done.stdout}\n{done.stderr}")
    yield


@pytest.fixture(scope="session")
def tiny_model():
    """results/assets/tiny-llama, the model the shipped tiny jobs name (built once, as `make demo` does)."""
    from restage.demo import ensure_tiny_model

    return ensure_tiny_model(REPO)


@dataclass(frozen=True)
class SubmittedRun:
    job_id: str
    trial_dir: Path

    def wait_completed(self) -> None:
        state = wait_finished(self.job_id)
        assert state == "COMPLETED", f"job {self.job_id} ended {state}:\n{failure_report(self.trial_dir)}"


@pytest.fixture(scope="session")
def reference_run(tiny_model, tmp_path_factory) -> SubmittedRun:
    """The reference job, uninterrupted; submitted, not waited for (a test that needs it finished calls
    ``wait_completed``, so other jobs can run meanwhile)."""
    results = tmp_path_factory.mktemp("reference") / "results"
    job_id, trial_dir = submit_real("jobs/ppo_tiny.yaml", results, "reference", *reference_overrides())
    return SubmittedRun(job_id, trial_dir)



@pytest.fixture
def selftest_config(tmp_path):
    """Write a self-test config (results under tmp_path) with nested updates; return its path."""

    def write(name="job.yaml", **sections):
        data = yaml.safe_load(yaml.safe_dump(SELFTEST))
        data["run"]["results_dir"] = str(tmp_path / "results")
        for key, value in sections.items():
            if isinstance(value, dict):
                data.setdefault(key, {}).update(value)
            else:
                data[key] = value
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data))
        return path

    return write
