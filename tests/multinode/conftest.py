"""Session fixtures of tests/multinode: the multinode cluster (scripts/slurm_multinode.sh) and the tiny model."""

import os
import subprocess

import pytest
from multinode_jobs import REPO, SCRIPT, SLURM_CONF


@pytest.fixture(scope="session")
def multinode_cluster():
    done = subprocess.run(["bash", str(SCRIPT), "start"], capture_output=True, text=True)
    if done.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip(f"no multinode cluster (not root): {done.stderr.strip().splitlines()[-1:]}")
        raise RuntimeError(f"scripts/slurm_multinode.sh start failed:\n{done.stdout}\n{done.stderr}")
    yield


@pytest.fixture(autouse=True)
def on_the_multinode_cluster(multinode_cluster, monkeypatch):
    """Every SLURM command of these tests (and the jobs they submit) talks to the multinode cluster."""
    monkeypatch.setenv("SLURM_CONF", str(SLURM_CONF))
    monkeypatch.setenv("RESTAGE_RANK_FACTS", "1")
    monkeypatch.setenv("RESTAGE_NODE_LOSS_WAIT_SECONDS", "40")


@pytest.fixture(scope="session")
def tiny_model():
    from restage.demo import ensure_tiny_model

    return ensure_tiny_model(REPO)


