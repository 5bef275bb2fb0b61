"""DeepSpeed ops: no JIT-compiled optimizer on GPUs; the one compiled op (offload) is built once per node."""

from __future__ import annotations

import os

import pytest
import torch

from restage.config import ModelSpec
from restage.runtime import ops
from restage.runtime.engines import deepspeed_config


def test_gpu_training_uses_torch_adamw_not_a_jit_built_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plain = deepspeed_config(ModelSpec(path="-", trainable=True, zero_stage=2), dp=2, micro_batches=1)
    assert plain["optimizer"]["type"] == "AdamW" and plain["optimizer"]["params"]["torch_adam"] is True
    offload = deepspeed_config(ModelSpec(path="-", trainable=True, zero_stage=2, offload_optimizer=True), dp=2,
                               micro_batches=1)
    assert "torch_adam" not in offload["optimizer"]["params"]  # DeepSpeed's CPU Adam steps the host copy
    assert ops.needed_ops([ModelSpec(path="-", trainable=True)]) == []
    assert ops.needed_ops([ModelSpec(path="-", trainable=True, offload_optimizer=True)]) == ["cpu_adam"]
    assert ops.needed_ops([ModelSpec(path="-", trainable=False, offload_optimizer=True)]) == []
    # DeepSpeed's cpu accelerator builds its shared-memory all-reduce when an engine starts: once per node, first.
    assert ops.needed_ops([ModelSpec(path="-", trainable=True)], accelerator="cpu") == ["deepspeed_shm_comm"]
    assert ops.needed_ops([ModelSpec(path="-", trainable=False)], accelerator="cpu") == []


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def test_a_killed_builds_lock_is_removed_and_a_live_one_kept(extensions_dir):
    lock = ops.lock_path("cpu_adam")
    assert extensions_dir in lock.parents
    lock.parent.mkdir(parents=True, exist_ok=True)  # torch makes the build directory when asked for it
    lock.touch()
    assert not ops.clear_stale_lock("cpu_adam", stale_seconds=600) and lock.exists()
    old = lock.stat().st_mtime - 601
    os.utime(lock, (old, old))
    assert ops.clear_stale_lock("cpu_adam", stale_seconds=600) and not lock.exists()
    assert not ops.clear_stale_lock("cpu_adam", stale_seconds=600)  # nothing left to remove


@pytest.mark.parametrize("leader", [True, False])
def test_only_the_node_leader_builds_before_the_barrier(extensions_dir, monkeypatch, leader):
    monkeypatch.setattr(ops, "_prebuilt", lambda name: False)
    lock = ops.lock_path("cpu_adam")
    lock.parent.mkdir(parents=True, exist_ok=True)  # torch makes the build directory when asked for it
    lock.touch()
    os.utime(lock, (1.0, 1.0))  # a lock from 1970: a killed build's
    events = []
    ops.prepare_ops(["cpu_adam"], node_leader=leader, node_barrier=lambda: events.append("barrier"),
                    load=lambda name: events.append(f"load {name} lock={lock.exists()}"))
    if leader:  # the stale lock is gone before the leader loads, so its build cannot wait on it forever
        assert events == ["load cpu_adam lock=False", "barrier"]
    else:  # the others wait for the leader's build, and never touch the lock themselves
        assert events == ["barrier", "load cpu_adam lock=True"]
    events.clear()
    ops.prepare_ops([], node_leader=leader, node_barrier=lambda: events.append("barrier"))
    assert events == []  # nothing to build: no barrier either
