"""The default KV-cache budget on a GPU counts what PyTorch's caching allocator holds reserved but unused (issue 28,
item 3): after a training step its cached blocks are free to PyTorch but not to ``torch.cuda.mem_get_info``."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from restage.models.arch import ModelConfig
from restage.rollout.budget import (
    GPU_FREE_MEMORY_FRACTION,
    RolloutLimits,
    available_device_bytes,
    gathers_once,
    gpu_kv_budget_bytes,
    kv_bytes_per_slot,
    plan_slots,
)

GIB = 1 << 30
CFG = ModelConfig(family="llama", model_type="llama", vocab_size=100, hidden_size=4096, intermediate_size=11008,
                  num_layers=32, num_heads=32, num_kv_heads=32, max_positions=4096)


def test_reserved_but_unallocated_memory_counts_as_available():
    # 80 GiB device, 2 GiB free; the allocator reserves 60 GiB of which 20 GiB are live tensors.
    assert available_device_bytes(2 * GIB, 80 * GIB, 60 * GIB, 20 * GIB) == 42 * GIB
    assert gpu_kv_budget_bytes(2 * GIB, 80 * GIB, 60 * GIB, 20 * GIB) == int(0.4 * 42 * GIB)
    assert available_device_bytes(5 * GIB, 80 * GIB, 20 * GIB, 20 * GIB) == 5 * GIB  # nothing cached: free alone
    assert available_device_bytes(70 * GIB, 80 * GIB, 30 * GIB, 0) == 80 * GIB  # never past the device
    assert available_device_bytes(0, 80 * GIB, 0, 0) == 0


def test_zero3_generation_gathers_once_when_the_copy_leaves_the_cache_its_share():
    assert gathers_once(int(0.6 * 42 * GIB), 42 * GIB)
    assert not gathers_once(int(0.6 * 42 * GIB) + 1, 42 * GIB)


def _cuda_stage():
    """What ``plan_slots`` reads of a module: one llama-7b stage in bf16 whose parameters live on ``cuda:0``."""
    ctx = SimpleNamespace(tp_size=1)
    weight = SimpleNamespace(device=torch.device("cuda", 0))
    return SimpleNamespace(cfg=CFG, ctx=ctx, layer_range=(0, 32), dtype=torch.bfloat16, parameters=lambda: iter([weight]))


def test_plan_slots_after_a_training_step_gets_the_cached_blocks(monkeypatch):
    """``plan_slots`` with a training step's 40 GiB cached (60 reserved, 20 allocated) and 2 GiB free on the device:
    the budget is 0.4 x 42 GiB (16 slots of 2,048 tokens), not 0.4 x 2 GiB (not one: the engine refused to start)."""
    free, total, reserved, allocated = 2 * GIB, 80 * GIB, 60 * GIB, 20 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: allocated)
    stage = _cuda_stage()
    slot = kv_bytes_per_slot(stage, 2048)  # 1 GiB: 2 x 32 layers x 2,048 tokens x 4,096 x 2 bytes
    assert slot == GIB
    got = plan_slots(stage, 1000, 2048, RolloutLimits(max_slots=1000))
    assert got == int(GPU_FREE_MEMORY_FRACTION * 42 * GIB) // slot == 16
    assert int(GPU_FREE_MEMORY_FRACTION * free) // slot == 0  # free memory alone: not one slot (refused)
