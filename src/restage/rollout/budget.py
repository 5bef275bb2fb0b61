"""How big the rollout engine's KV cache may grow, and the cache it builds.

The cache is either contiguous, ``[slots, max_len, H_kv, D]`` per layer with as many slots as the memory budget
holds (``RolloutLimits``), or paged (``paged_cache.py``): the slots' keys/values in blocks from a pool, taken as
answers grow and given back when they end, a group's prompt blocks held once. ``generation.kv_cache=auto`` pages
where flash-attn's paged kernel reads the blocks in place (``flash_pages``); elsewhere a gather per layer and step
would cost more than slots waste. The planner's estimator uses the same figures (``GPU_FREE_MEMORY_FRACTION``,
``slot_count``, ``group_count``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

import torch
import torch.distributed as dist

from restage.config.sections import GenerationConfig
from restage.errors import ConfigError
from restage.models.attention import KVStore, flash_installed
from restage.models.decoder import StageModule
from restage.rollout.paged_cache import DEFAULT_BLOCK_TOKENS, FLASH_BLOCK_TOKENS, PagedKVCache, blocks_for
from restage.rollout.slots import slot_groups


@dataclass(frozen=True)
class RolloutLimits:
    """How big the engine may grow (``generate`` takes the first two from ``generation.kv_cache_gib`` and ``max_slots``)."""

    kv_cache_bytes: int | None = None  # None: 2 GiB on CPU, 40% of the free memory on a GPU
    max_slots: int = 64
    check_every_steps: int = 4  # k: one host sync per k decode steps; a finished request idles < k steps
    # Micro-groups of slots in flight through the pipeline at once (pipelined.py): None is pp
    # (no bubble), 1 steps all slots through the stages one after another; else at least pp.
    pp_groups: int | None = None
    # The cache's layout (``generation.kv_cache``): blocks from a shared pool (paged_cache.py; concurrency bounded by
    # the tokens held), or a slot of the longest possible sequence per request (contiguous); None (auto): paged where
    # flash-attn's paged kernel reads the blocks in place (``flash_pages``), else contiguous.
    paged: bool | None = None
    block_tokens: int = 0  # a block's positions (``generation.kv_block_tokens``); 0: ``block_tokens_for`` decides

    @classmethod
    def of(cls, kv_cache_gib: float, max_slots: int, paged: bool | None = None,
           block_tokens: int = 0) -> RolloutLimits:
        """The limits ``generation.kv_cache_gib`` (0: sized from free memory), ``max_slots``, ``kv_cache`` (paged or
        not) and ``kv_block_tokens`` set."""
        return cls(kv_cache_bytes=int(kv_cache_gib * (1 << 30)) if kv_cache_gib > 0 else None, max_slots=max_slots,
                   paged=paged, block_tokens=block_tokens)

    @classmethod
    def of_params(cls, params: GenerationConfig) -> RolloutLimits:
        """``of`` a ``GenerationConfig`` (or the ``SamplingParams`` that extend it)."""
        paged: bool | None
        match params.kv_cache:
            case "auto":
                paged = None
            case "paged":
                paged = True
            case "contiguous":
                paged = False
            case _:
                assert_never(params.kv_cache)
        return cls.of(params.kv_cache_gib, params.max_slots, paged, params.kv_block_tokens)


def kv_bytes_per_slot(module: StageModule, max_len: int) -> int:
    """Bytes one slot of this stage's cache takes (keys and values of its layers)."""
    layers = module.layer_range[1] - module.layer_range[0]
    kv_heads = module.cfg.num_kv_heads // module.ctx.tp_size
    return 2 * layers * max_len * kv_heads * module.cfg.head_dim * module.dtype.itemsize


# The KV cache budget when ``RolloutLimits.kv_cache_bytes`` is None (the planner's estimate uses the same figures).
GPU_FREE_MEMORY_FRACTION = 0.4  # of the device memory available when the engine is built (``available_device_bytes``)
CPU_KV_CACHE_BYTES = 2 << 30
# ZeRO-3 generation in place (``runtime/store/zero3_generation.py``, the planner's ``simulator.zero3_generation_mode``):
# the stage's parameters are gathered once for the call when they fit in the share of the available memory that the
# default KV-cache budget leaves (the cache then gets GPU_FREE_MEMORY_FRACTION of what the copy leaves, at least
# 0.4 x 0.4 = 16% of the available memory); else the replicas step in lockstep, one unit gathered at a time.
GATHER_ONCE_FRACTION = 1 - GPU_FREE_MEMORY_FRACTION


def available_device_bytes(free: int, total: int, reserved: int, allocated: int) -> int:
    """Memory this process can still fill on its GPU: the device's free memory (``torch.cuda.mem_get_info``) plus
    what PyTorch's caching allocator holds reserved but not allocated (a training step's cached blocks, which the
    device counts as used), at most ``total``."""
    return max(0, min(total, free + max(0, reserved - allocated)))


def gpu_kv_budget_bytes(free: int, total: int, reserved: int, allocated: int) -> int:
    """The default KV cache budget on a GPU: ``GPU_FREE_MEMORY_FRACTION`` of ``available_device_bytes``, as the
    planner's ``restage_slots`` takes it of the usable memory the rank's weights leave."""
    return int(GPU_FREE_MEMORY_FRACTION * available_device_bytes(free, total, reserved, allocated))


def cuda_available_bytes(device: torch.device) -> int:
    """``available_device_bytes`` of ``device`` (a CUDA device), measured now."""
    free, total = torch.cuda.mem_get_info(device)
    return available_device_bytes(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def gathers_once(gathered_bytes: int, available_bytes: int) -> bool:
    """ZeRO-3 generation in place: whether the stage's parameters are gathered once for the call (``gathered_bytes``
    within ``GATHER_ONCE_FRACTION`` of ``available_bytes``) rather than in every forward, the replicas in lockstep."""
    return gathered_bytes <= GATHER_ONCE_FRACTION * available_bytes


def slot_count(budget_bytes: int, slot_bytes: int, num_requests: int, max_slots: int) -> int:
    """Cache slots of ``slot_bytes`` each: as many as ``budget_bytes`` holds, at most ``max_slots`` and the requests
    (0 when the budget holds no slot; ``plan_slots`` refuses that)."""
    return min(max_slots, num_requests, budget_bytes // max(1, slot_bytes))


def kv_budget_bytes(module: StageModule, limits: RolloutLimits) -> int:
    """The bytes this stage's KV cache may take: ``limits.kv_cache_bytes``, or the default budget."""
    if limits.kv_cache_bytes is not None:
        return limits.kv_cache_bytes
    device = next(module.parameters()).device
    return int(GPU_FREE_MEMORY_FRACTION * cuda_available_bytes(device)) if device.type == "cuda" else CPU_KV_CACHE_BYTES


def plan_slots(module: StageModule, num_requests: int, max_len: int, limits: RolloutLimits) -> int:
    """Number of cache slots: as many as the budget holds, at most ``max_slots`` and the request count."""
    budget = kv_budget_bytes(module, limits)
    slot_bytes = kv_bytes_per_slot(module, max_len)
    if num_requests and budget < slot_bytes:
        raise ConfigError(f"a KV cache slot of {max_len} tokens needs {slot_bytes} bytes, over "
                          f"the budget of {budget}; raise kv_cache_bytes or shorten prompts / max_new_tokens")
    return slot_count(budget, slot_bytes, num_requests, limits.max_slots)


def block_tokens_for(module: StageModule, limits: RolloutLimits) -> int:
    """A paged cache's block: ``limits.block_tokens``, else 256 positions where flash-attn's paged decode kernel
    serves (CUDA, half precision, installed: its blocks must be a multiple of 256), else 16."""
    if limits.block_tokens:
        return limits.block_tokens
    return FLASH_BLOCK_TOKENS if flash_pages(module) else DEFAULT_BLOCK_TOKENS


def flash_pages(module: StageModule) -> bool:
    """Whether flash-attn's paged decode kernel serves this stage (installed, CUDA, half precision). Without it a
    paged cache gathers each row's blocks into one span per layer and step, an extra write and read of the keys and
    values that the contiguous cache does not make: ``generation.kv_cache=auto`` then keeps the contiguous one."""
    device = next(module.parameters()).device
    return (flash_installed() and device.type == "cuda"
            and module.dtype in (torch.float16, torch.bfloat16))


def least_over_stages(module: StageModule, value: int) -> int:
    """The smallest ``value`` over the replica's pipeline stages (one all-reduce under pp): every stage keeps the
    same host state, so its slot and block counts must agree though its layers and free memory differ."""
    ctx = module.ctx
    if ctx.pp_size == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=next(module.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.pp_group)
    return int(flag.item())


def new_rollout_cache(module: StageModule, num_requests: int, max_len: int, limits: RolloutLimits,
                      num_groups: int) -> KVStore | None:
    """The engine's cache for ``num_requests`` requests (None when there are none) of at most ``max_len`` tokens.

    Contiguous: ``plan_slots`` slots of ``max_len``. Paged: ``min(max_slots, requests)`` rows over a pool of
    blocks, as many as the budget holds and at most every row's ``max_len`` (more would never be used), split into
    one pool per micro-group of ``num_groups``; each pool must hold one sequence of ``max_len``."""
    if not (limits.paged if limits.paged is not None else flash_pages(module)):
        slots = least_over_stages(module, plan_slots(module, num_requests, max_len, limits))
        return module.new_cache(slots, max_len) if slots else None
    rows = min(limits.max_slots, num_requests)
    if not rows:
        return None
    block_tokens = block_tokens_for(module, limits)
    per_row = blocks_for(max_len, block_tokens)
    budget_blocks = kv_budget_bytes(module, limits) // kv_bytes_per_slot(module, block_tokens)
    pools = [(g.start, g.stop) for g in slot_groups(rows, num_groups) if g.size]
    blocks = least_over_stages(module, min(budget_blocks, rows * per_row))
    if blocks // len(pools) < per_row:
        raise ConfigError(f"a paged KV cache of {blocks} blocks of {block_tokens} tokens cannot hold one sequence of "
                          f"{max_len} tokens in each of {len(pools)} micro-group(s) ({per_row} blocks each); raise "
                          "generation.kv_cache_gib or shorten prompts / max_new_tokens")
    kv_heads = module.cfg.num_kv_heads // module.ctx.tp_size
    return PagedKVCache(range(*module.layer_range), rows, max_len, block_tokens, blocks, kv_heads, module.cfg.head_dim,
                        module.dtype, next(module.parameters()).device, pools)


def group_count(pp_groups: int | None, pp_size: int) -> int:
    """Micro-groups of slots in flight through ``pp_size`` stages (``RolloutLimits.pp_groups``; the estimator uses it too)."""
    if pp_groups is None:
        return pp_size
    if pp_groups != 1 and pp_groups < pp_size:
        raise ConfigError(f"pp_groups={pp_groups} under pp={pp_size}: use 1 (stages one after another) or at least "
                          f"{pp_size} (a group for every stage), or leave it unset")
    return pp_groups
