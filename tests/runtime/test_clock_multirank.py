"""Timestamps on one clock: every rank's offset to the master's, measured over MPI; timings that wait for the device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from restage.launch.mpirun import mpirun_command
from restage.runtime.control.clock import Clock, device_sync, offset_from_rounds, peak_memory_bytes

pytestmark = pytest.mark.multirank


def test_ranks_on_skewed_clocks_measure_their_offsets(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from clock_ranks import SKEW_SECONDS

    out = tmp_path / "offsets.json"
    command = mpirun_command(3, [sys.executable, str(Path(__file__).parent / "clock_ranks.py"), str(out)])
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    offsets = json.loads(out.read_text())
    # Rank r reads rank-0 time + r * SKEW; its offset must bring it back, to within a loopback round trip.
    for rank, offset in enumerate(offsets):
        assert offset == pytest.approx(-rank * SKEW_SECONDS, abs=0.05), f"rank {rank}: {offset}"


def test_offset_takes_the_fastest_round_and_its_midpoint():
    # (sent, master's reading, received) on a clock 10 s behind the master: the 2 ms round wins over the 50 ms one.
    rounds = [(100.0, 110.040, 100.050), (101.0, 111.001, 101.002)]
    assert offset_from_rounds(rounds) == pytest.approx(10.0, abs=1e-9)


def test_timestamps_wait_for_the_device(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    gpu = torch.device("cuda", 3)
    ticks = iter([5.0, 9.0])
    clock = Clock(offset_seconds=2.0, device=gpu, local_clock=lambda: next(ticks))
    assert (clock.now_synced(), clock.now()) == (7.0, 11.0)
    assert waited == [gpu]  # the synced reading waited for that very device first, the plain one did not
    device_sync(torch.device("cpu"))()  # nothing to wait for on a CPU
    assert waited == [gpu]


def test_peak_memory_counts_what_lives_outside_the_allocator(monkeypatch):
    gib = 2 ** 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))  # 20 GiB used on the device
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 17 * gib)  # PyTorch holds 17 of them
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 15 * gib)
    # 3 GiB are CUDA context and NCCL buffers: on top of PyTorch's 15 GiB peak.
    assert peak_memory_bytes(torch.device("cuda", 0)) == 18 * gib
    assert peak_memory_bytes(torch.device("cpu")) > 0
