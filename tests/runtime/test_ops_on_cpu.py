"""DeepSpeed ops: no JIT-compiled optimizer on GPUs; the one compiled op (offload) is built once per node."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from restage.config.sections import ModelSpec
from restage.runtime.store import deepspeed_ops
from restage.runtime.store.zero_engines import deepspeed_config


def test_gpu_training_uses_torch_adamw_not_a_jit_built_op(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plain = deepspeed_config(ModelSpec(path="-", trainable=True, zero_stage=2), dp=2, micro_batches=1)
    assert plain["optimizer"]["type"] == "AdamW" and plain["optimizer"]["params"]["torch_adam"] is True
    offload = deepspeed_config(ModelSpec(path="-", trainable=True, zero_stage=2, offload_optimizer=True), dp=2,
                               micro_batches=1)
    assert "torch_adam" not in offload["optimizer"]["params"]  # DeepSpeed's CPU Adam steps the host copy
    assert deepspeed_ops.needed_ops([ModelSpec(path="-", trainable=True)]) == []
    assert deepspeed_ops.needed_ops([ModelSpec(path="-", trainable=True, offload_optimizer=True)]) == ["cpu_adam"]
    assert deepspeed_ops.needed_ops([ModelSpec(path="-", trainable=False, offload_optimizer=True)]) == []
    # DeepSpeed's cpu accelerator builds its shared-memory all-reduce when an engine starts: once per node, first.
    assert deepspeed_ops.needed_ops([ModelSpec(path="-", trainable=True)], accelerator="cpu") == ["deepspeed_shm_comm"]
    assert deepspeed_ops.needed_ops([ModelSpec(path="-", trainable=False)], accelerator="cpu") == []


@pytest.fixture
def extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _holder(lock, *, restage_lock: bool, seconds: float) -> subprocess.Popen:
    """A process that holds the build locks as a loading rank does (restage's lease, torch's lock file open), then
    releases them as torch does; returns once it holds them."""
    code = f"""
import os, time
from pathlib import Path
from restage.locks import HostLock
if {restage_lock}:
    restage = HostLock(Path({str(lock.parent)!r}), "restage")
    assert restage.try_acquire()
    restage.name_holder()
baton = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL)
print("held", flush=True)
time.sleep({seconds})
os.close(baton)
os.remove({str(lock)!r})
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_lock_left_by_a_dead_pid_is_reported_and_removed(extensions_dir):
    lock = deepspeed_ops.lock_path("cpu_adam")
    assert extensions_dir in lock.parents
    lock.parent.mkdir(parents=True, exist_ok=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)
    (lock.parent / "restage.holder").write_text(f"pid {dead_pid} on {socket.gethostname()}\n")  # its last holder
    lock.touch()  # torch's lock, never removed: the holder was killed mid-build
    said = []
    with deepspeed_ops.build_lock("cpu_adam", say=said.append):
        assert not lock.exists()
        assert (lock.parent / "restage.holder").read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    assert said == [f"restage: removing {lock}: left by pid {dead_pid} on {socket.gethostname()}, which died while "
                    "loading or building cpu_adam (no live process holds restage's build lock or has the file open)"]


def test_a_live_holder_is_waited_for_with_its_name_and_its_lock_removed_once_it_is_killed(extensions_dir):
    lock = deepspeed_ops.lock_path("cpu_adam")
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = _holder(lock, restage_lock=True, seconds=600)
    said, doing = [], []
    # a rank killed while it builds, and reaped (a zombie's pid is still taken, as mpirun's children are not)
    killer = threading.Timer(1.5, lambda: (holder.kill(), holder.wait()))
    killer.start()
    started = time.monotonic()
    with deepspeed_ops.build_lock("cpu_adam", say=said.append, doing=lambda what, waiting=False: doing.append((what, waiting)),
                        poll_seconds=0.05, notice_seconds=0.5):
        waited = time.monotonic() - started
    holder.wait()
    host = socket.gethostname()
    assert waited >= 1.4 and not lock.exists()
    assert said[0] == (f"restage: rank waits for pid {holder.pid} on {host}, which holds restage's build lock of "
                       f"DeepSpeed's cpu_adam op ({lock.parent}); 0 s so far")
    assert len(said) >= 3 and said[-1].startswith(f"restage: removing {lock}: left by pid {holder.pid} on {host}")
    assert doing[0] == (f"start-up: waiting for pid {holder.pid} on {host}, which holds restage's build lock of "
                        "cpu_adam", True)


def test_a_build_outside_restage_holding_torchs_lock_is_waited_for_not_broken(extensions_dir):
    lock = deepspeed_ops.lock_path("cpu_adam")
    lock.parent.mkdir(parents=True, exist_ok=True)
    holder = _holder(lock, restage_lock=False, seconds=1.0)
    said = []
    with deepspeed_ops.build_lock("cpu_adam", say=said.append, poll_seconds=0.05, notice_seconds=10):
        assert not lock.exists()
    # The holder removed its lock itself (os.remove would have failed had the wait broken it), then exited.
    assert holder.wait(timeout=30) == 0
    assert said == [f"restage: rank waits for pid {holder.pid} on {socket.gethostname()}, which holds torch's build "
                    f"lock of DeepSpeed's cpu_adam op ({lock.parent}); 0 s so far"]


def test_builds_go_to_a_per_user_per_version_directory(monkeypatch, tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    import deepspeed

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    expected = tmp_path / "restage" / "torch_extensions" / f"{python}-torch{torch.__version__}-deepspeed{deepspeed.__version__}"
    assert deepspeed_ops.use_extensions_dir(env) == expected and env["TORCH_EXTENSIONS_DIR"] == str(expected)
    assert deepspeed_ops.use_extensions_dir({"TORCH_EXTENSIONS_DIR": "/elsewhere"}) == Path("/elsewhere")  # the user's wins


@pytest.mark.parametrize("leader", [True, False])
def test_only_the_node_leader_builds_before_the_barrier(extensions_dir, monkeypatch, leader):
    monkeypatch.setattr(deepspeed_ops, "_prebuilt", lambda name: False)
    lock = deepspeed_ops.lock_path("cpu_adam")
    lock.parent.mkdir(parents=True, exist_ok=True)  # torch makes the build directory when asked for it
    lock.touch()  # a killed build's: nobody holds it
    events = []
    deepspeed_ops.prepare_ops(["cpu_adam"], node_leader=leader, node_barrier=lambda: events.append("barrier"),
                    load=lambda name: events.append(f"load {name} lock={lock.exists()}"))
    # The stale lock is gone before the load, so it cannot wait on it forever; the others wait for the leader.
    assert events == (["load cpu_adam lock=False", "barrier"] if leader else ["barrier", "load cpu_adam lock=False"])
    events.clear()
    deepspeed_ops.prepare_ops([], node_leader=leader, node_barrier=lambda: events.append("barrier"))
    assert events == []  # nothing to build: no barrier either


@pytest.mark.parametrize("code", [errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_flock_still_builds_once(extensions_dir, monkeypatch, code):
    def no_flock(*args):  # Lustre mounted without flock, NFS without its lock manager
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    monkeypatch.setattr(deepspeed_ops, "_prebuilt", lambda name: False)
    events = []
    deepspeed_ops.prepare_ops(["cpu_adam"], node_leader=True, node_barrier=lambda: events.append("barrier"),
                    load=lambda name: events.append(f"load {name}"))
    assert events == ["load cpu_adam", "barrier"]
    assert not (deepspeed_ops.lock_path("cpu_adam").parent / "restage.lease").exists()  # released


# One node's rank, on a file system whose flock is node-local (each node "gets" it): it builds for a second.
NODE = """
import fcntl, json, socket, sys, time
fcntl.flock = lambda *args: None
socket.gethostname = lambda: sys.argv[1]
from restage.runtime.store import deepspeed_ops
with deepspeed_ops.build_lock("cpu_adam", say=lambda line: None, poll_seconds=0.05):
    start = time.time()
    time.sleep(1.0)
    end = time.time()
print(json.dumps([start, end]))
"""


def test_two_nodes_never_build_into_one_directory_at_once(extensions_dir):
    nodes = [subprocess.Popen([sys.executable, "-c", NODE, f"node-{i}"], stdout=subprocess.PIPE, text=True)
             for i in range(2)]
    spans = sorted(json.loads(node.communicate(timeout=120)[0]) for node in nodes)
    assert all(node.returncode == 0 for node in nodes)
    assert spans[0][1] <= spans[1][0], spans  # one after the other
