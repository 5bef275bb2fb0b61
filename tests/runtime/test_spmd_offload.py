"""Offloading an idle frozen model between its MFCs changes where it waits, not what it computes."""

import pytest
import torch
from runs import hf_weights, last_checkpoint, restage_run

from restage.schedule.file import read_schedule

pytestmark = pytest.mark.e2e

JOB = ["jobs/ppo_tiny.yaml", "-n", "1", "run.steps=2", "run.batch_size=8"]


def test_offloaded_reference_gives_the_same_training(tmp_path):
    for trial, extra in (("kept", []), ("offloaded", ["models.ref.offload_when_idle=true"])):
        done = restage_run(tmp_path, *JOB, f"trial={trial}", *extra)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    kinds = [op.kind for op in read_schedule(tmp_path / "ppo-tiny" / "offloaded" / "schedule.json").ops()]
    assert kinds.count("offload") == 1 and kinds.count("reload") == 1
    a = hf_weights(last_checkpoint(tmp_path / "ppo-tiny" / "kept") / "actor" / "hf")
    b = hf_weights(last_checkpoint(tmp_path / "ppo-tiny" / "offloaded") / "actor" / "hf")
    assert all(torch.equal(a[k], b[k]) for k in a)
