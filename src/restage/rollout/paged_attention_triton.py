"""A Triton kernel for decode attention over the paged KV cache (``paged_cache.PagedKVCache``), for CUDA GPUs where
flash-attn's paged kernel does not serve.

One program per (row, kv head): the query heads of that kv head (its GQA group, padded to 16 rows so ``tl.dot``
applies) walk the row's positions through its block table in tiles of ``TILE`` positions (a tile may cross a block
edge when the block is not a multiple of it), with an fp32 online softmax. The row's length is read on the device,
so a CUDA graph captured once replays at other lengths; the loop covers ``length + 1`` keys (this step's token is
written into its block before the kernel runs), from the window's first when the attention has one.

Written here rather than taken elsewhere: flash-attn's paged kernel needs blocks that are multiples of 256 tokens
and half precision (a 256-token block wastes most of a short row's last block), and vLLM's paged-attention kernels
are bound to vLLM's cache layout, build and custom ops. Triton comes with PyTorch's CUDA wheels; it is imported
only when the kernel first runs, so this module and ``paged_cache`` import without it.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

TILE_TOKENS = 32  # positions per loop step: a multiple of 16 for tl.dot; crosses 16-token blocks' edges
MIN_GROUP_ROWS = 16  # tl.dot's smallest M: a GQA group of fewer query heads is padded to it
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def triton_installed() -> bool:
    """Whether triton imports here (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules holds None for it: importing it fails
        return False


def head_dim_supported(head_dim: int) -> bool:
    """``tl.arange`` needs a power of two; ``tl.dot`` at least 16."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs queries of ``dtype`` and ``head_dim`` (triton installed)."""
    return dtype in DTYPES and head_dim_supported(head_dim) and triton_installed()


def serves(q: torch.Tensor) -> bool:
    """Whether the kernel serves this decode: a CUDA tensor it supports (a CPU has no Triton backend)."""
    return q.is_cuda and supports(q.dtype, q.shape[-1])


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, built on first use (triton is a heavy optional import)."""
    import triton
    import triton.language as tl

    # Triton's parameters are typed by what is passed (annotations would mean constexprs): untyped for mypy.
    @triton.jit  # type: ignore[untyped-decorator]
    def paged_decode(q_ptr, k_ptr, v_ptr, table_ptr, lengths_ptr, out_ptr,  # type: ignore[no-untyped-def]
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_tb, stride_ob, stride_oh,
                     scale, window,
                     GROUP: tl.constexpr, GROUP_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_TOKENS: tl.constexpr, TILE: tl.constexpr, HAS_WINDOW: tl.constexpr,
                     PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, GROUP_ROWS)
        d = tl.arange(0, HEAD_DIM)
        t = tl.arange(0, TILE)
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        keys = tl.load(lengths_ptr + row).to(tl.int32) + 1  # positions 0 .. length, this step's included
        first = 0
        if HAS_WINDOW:
            first = tl.maximum(keys - window, 0)
        m = tl.full((GROUP_ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((GROUP_ROWS,), tl.float32)
        acc = tl.zeros((GROUP_ROWS, HEAD_DIM), tl.float32)
        # Every tile holds at least one seen key (the first holds `first`, the others their own start), so the
        # running maximum is finite after the first and no exp(-inf - -inf) is taken.
        for start in range((first // TILE) * TILE, keys, TILE):
            pos = start + t
            seen = (pos < keys) & (pos >= first)
            block = tl.load(table_ptr + row * stride_tb + pos // BLOCK_TOKENS, mask=pos < keys, other=0)
            where = block.to(tl.int64) * stride_kb + (pos % BLOCK_TOKENS) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + where[:, None] + d[None, :], mask=seen[:, None], other=0.0)
            v = tl.load(v_ptr + where[:, None] + d[None, :], mask=seen[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(seen[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])

    return paged_decode


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                           lengths: torch.Tensor, scale: float, window: int | None) -> torch.Tensor:
    """Attend ``q`` ``[B, H, D]`` (one new token per row) to row ``b``'s positions ``0 .. lengths[b]`` (already
    written) in the pools ``[blocks + 1, block_tokens, H_kv, D]`` through ``table`` ``[B, max_blocks]``; only the
    last ``window`` of them where ``window`` is set. Returns ``[B, H, D]``."""
    rows, heads, head_dim = q.shape
    kv_heads = k_pool.shape[2]
    group = heads // kv_heads
    q = q.contiguous()
    assert k_pool.is_contiguous() and v_pool.is_contiguous() and table.stride(1) == 1
    out = torch.empty_like(q)
    group_rows = max(MIN_GROUP_ROWS, 1 << (group - 1).bit_length())
    # fp32 in, fp32 products: tl.dot would otherwise round fp32 inputs to tf32 on the GPU.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _kernel()[(rows, kv_heads)](
        q, k_pool, v_pool, table, lengths, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), table.stride(0),
        out.stride(0), out.stride(1), scale, window or 0,
        GROUP=group, GROUP_ROWS=group_rows, HEAD_DIM=head_dim, BLOCK_TOKENS=k_pool.shape[1], TILE=TILE_TOKENS,
        HAS_WINDOW=window is not None, PRECISION=precision)
    return out
