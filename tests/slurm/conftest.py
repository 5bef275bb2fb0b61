"""The local one-node SLURM cluster (scripts/slurm_local.sh), started once per session, and a config writer."""

import os
import subprocess

import pytest
import yaml
from slurm_jobs import REPO, SELFTEST


@pytest.fixture(scope="session", autouse=True)
def slurm_cluster():
    """Start (or check) the local cluster; skip only when not root and it cannot be started."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "slurm_local.sh"), "start"], capture_output=True, text=True)
    if done.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip(f"no local SLURM cluster (not root): {done.stderr.strip().splitlines()[-1:]}")
        raise RuntimeError(f"scripts/slurm_local.sh start failed:\n{done.stdout}\n{done.stderr}")
    yield


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

