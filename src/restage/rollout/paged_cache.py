"""A paged KV cache: rows (the rollout engine's slots) hold their keys/values in blocks taken from a shared pool.

Each layer keeps one pool ``[blocks + 1, block_tokens, H_kv_local, D]``; the last block is scratch: the table
entries a row does not use point at it, so a free slot's decode step writes there and a real row's unused
positions read there (masked). Row ``r``'s position ``p`` lives in block ``table[r, p // block_tokens]`` at
offset ``p % block_tokens``.

The host owns the bookkeeping, exactly (nothing is read back from the device): ``held[r]`` lists row ``r``'s
blocks in position order and ``refs`` counts the rows holding each block. A row takes blocks as its sequence
grows (``hold``) and gives them back when it leaves (``release``); a prompt's full blocks are held once and
shared by the siblings that continue it (``hold(..., share_from=...)``: the blocks' count goes up, nothing is
copied), and only the partial last block is copied for each sibling (``copy_prefix``), since their answers write
into it. Compacting moves a row by moving its table entries (``move``), no key or value is copied.

The rows may be split into pools (``pools``: one per pipelined micro-group of slots) so that one group's rows
never wait on another's blocks; a row shares only blocks of its own pool and copies the others.

Attention reads the block table by one of three paths (``paged_kernel``): flash-attn's ``flash_attn_with_kvcache``
with ``block_table`` where it serves (CUDA, half precision, installed, blocks a multiple of 256 tokens, its
requirement); else on a CUDA GPU with triton, restage's own kernel (``paged_attention_triton``: any block size,
fp16/bf16/fp32, each row read to its own length on the device); otherwise (a CPU) one gather of the rows' first
blocks per layer, then the same masked SDPA as the contiguous cache (``attention.decode_sdpa``), which keeps every
shape fixed for a CUDA graph when the span is fixed. The block table is a static device buffer
the host rewrites (``flush``) before a forward whenever a row took or gave back blocks.

Written here rather than taken from vLLM or SGLang: their caches are bound to their own schedulers, kernels and
process models; the pieces restage needs (a free list, counts, one table) are a few dozen lines.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal, assert_never

import torch

from restage.models.attention import Decode, KVStore, Prefill, decode_sdpa, flash_decode, use_flash
from restage.models.packing import PackedBatch
from restage.rollout import paged_attention_triton

DEFAULT_BLOCK_TOKENS = 16  # the gather path's block: small blocks waste little of a row's last block
FLASH_BLOCK_TOKENS = 256  # flash-attn 2's paged kernel needs page_block_size % 256 == 0


PagedKernel = Literal["flash", "triton", "gather"]


def paged_kernel(q: torch.Tensor, block_tokens: int) -> PagedKernel:
    """Which path reads a paged cache for this decode: flash-attn's paged kernel where it serves, else the Triton
    kernel (CUDA, triton installed, a supported dtype and head dim), else the gather and SDPA."""
    if use_flash(q) and block_tokens % FLASH_BLOCK_TOKENS == 0:
        return "flash"
    if paged_attention_triton.serves(q):
        return "triton"
    return "gather"


def blocks_for(tokens: int, block_tokens: int) -> int:
    """Blocks that hold ``tokens`` positions."""
    return -(-tokens // block_tokens)


class PagedKVCache(KVStore):
    """Keys and values of one stage's layers in ``num_blocks`` blocks of ``block_tokens`` (see the module doc).

    ``pools``: row ranges ``(start, stop)`` whose rows share one free list; the blocks are split among them as
    evenly as possible (one pool over all rows when None)."""

    def __init__(self, layers: Iterable[int], rows: int, max_len: int, block_tokens: int, num_blocks: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str | None,
                 pools: list[tuple[int, int]] | None = None):
        super().__init__(rows, max_len)
        self.block_tokens, self.num_blocks = block_tokens, num_blocks
        self.max_blocks = blocks_for(max_len, block_tokens)  # table width: a row of max_len tokens
        self.scratch = num_blocks
        shape = (num_blocks + 1, block_tokens, kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.table = torch.full((rows, self.max_blocks), self.scratch, dtype=torch.int32, device=device)
        self.host_table = torch.full((rows, self.max_blocks), self.scratch, dtype=torch.int32)  # kept as held changes
        self.held: list[list[int]] = [[] for _ in range(rows)]
        self.refs = [0] * num_blocks
        pools = pools or [(0, rows)]
        self.pool_of_row = [0] * rows
        self.owner = [0] * num_blocks
        self.free: list[list[int]] = []
        for p, (start, stop) in enumerate(pools):
            self.pool_of_row[start:stop] = [p] * (stop - start)
            first, last = p * num_blocks // len(pools), (p + 1) * num_blocks // len(pools)
            self.owner[first:last] = [p] * (last - first)
            self.free.append(list(range(last - 1, first - 1, -1)))  # pop() gives the lowest first
        self.dirty = False
        self.peak_blocks = 0  # most blocks held at once over the cache's life (the bench's and tests' figure)

    # ---- host side -----------------------------------------------------------------------------------------
    def pool_blocks(self, row: int) -> int:
        """Blocks of ``row``'s pool (free or held)."""
        pool = self.pool_of_row[row]
        return sum(1 for owner in self.owner if owner == pool)

    def blocks_held(self) -> int:
        """Blocks some row holds now."""
        return self.num_blocks - sum(len(f) for f in self.free)

    def hold(self, row: int, tokens: int, share_from: int | None = None, shared_tokens: int = 0) -> bool:
        """Give ``row`` the blocks for ``tokens`` positions: first, when it starts with ``share_from``'s first
        ``shared_tokens`` positions and the two rows share a pool, that row's full blocks of them (counted, not
        copied); then new blocks from the pool. False, taking nothing, when the pool has too few."""
        held = self.held[row]
        if tokens > self.max_len:  # never room: waiting for it would never end
            raise ValueError(f"cache row {row}: {tokens} positions exceed the cache's max_len {self.max_len}")
        shared: list[int] = []
        if not held and share_from is not None and self.pool_of_row[share_from] == self.pool_of_row[row]:
            shared = self.held[share_from][: shared_tokens // self.block_tokens]
        need = blocks_for(tokens, self.block_tokens) - len(held) - len(shared)
        free = self.free[self.pool_of_row[row]]
        if need > len(free):
            return False
        for block in shared:
            self.refs[block] += 1
            self.host_table[row, len(held)] = block
            held.append(block)
        for _ in range(max(0, need)):
            block = free.pop()
            self.refs[block] = 1
            self.host_table[row, len(held)] = block
            held.append(block)
        self.dirty = self.dirty or bool(shared) or need > 0
        self.peak_blocks = max(self.peak_blocks, self.blocks_held())
        return True

    def release(self, row: int) -> None:
        """Row ``row``'s blocks go back to its pool (a shared one when its last holder leaves)."""
        for block in self.held[row]:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[self.owner[block]].append(block)
        if self.held[row]:
            self.host_table[row, :len(self.held[row])] = self.scratch
            self.held[row] = []
            self.dirty = True

    def move(self, source: int, target: int, num_tokens: int) -> None:
        """Row ``source``'s blocks become ``target``'s (their table entries move; no key or value is copied)."""
        assert not self.held[target] and self.pool_of_row[source] == self.pool_of_row[target]
        self.held[target], self.held[source] = self.held[source], []
        self.host_table[target] = self.host_table[source]
        self.host_table[source] = self.scratch
        self.dirty = True

    def flush(self) -> None:
        """Write the host's block lists into the device table (one copy), if any changed since the last flush."""
        if not self.dirty:
            return
        # In place: a captured decode step reads this buffer. A copy, not the host tensor itself: a non-blocking
        # copy from pageable memory may still be reading it when the host changes it next.
        self.table.copy_(self.host_table.clone() if self.table.is_cuda else self.host_table, non_blocking=True)
        self.dirty = False

    def copy_prefix(self, source: int, targets: list[int], num_tokens: int) -> None:
        """Give rows ``targets`` (already holding their blocks) ``source``'s first ``num_tokens`` keys/values:
        positions in blocks they share with ``source`` are already there; the rest are copied (one indexed copy
        per pool tensor for all targets)."""
        src: list[int] = []
        dst: list[int] = []
        for target in targets:
            for j in range(blocks_for(num_tokens, self.block_tokens)):
                a, b = self.held[source][j], self.held[target][j]
                if a != b:
                    count = min(self.block_tokens, num_tokens - j * self.block_tokens)
                    src.extend(a * self.block_tokens + o for o in range(count))
                    dst.extend(b * self.block_tokens + o for o in range(count))
        if not src:
            return
        device = self.table.device
        src_index, dst_index = (torch.tensor(x).to(device, non_blocking=True) for x in (src, dst))
        for pool in (*self.k.values(), *self.v.values()):
            flat = pool.view(-1, *pool.shape[2:])
            flat.index_copy_(0, dst_index, flat.index_select(0, src_index))

    # ---- device side ---------------------------------------------------------------------------------------
    def _flat(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool index (block * block_tokens + offset) of ``positions`` of ``rows``."""
        blocks = self.table[rows, positions // self.block_tokens].long()
        return blocks * self.block_tokens + positions % self.block_tokens

    def prefill(self, layer: int, meta: Prefill, batch: PackedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a packed batch's keys/values (one sequence per row, at their positions) into the rows' blocks."""
        seq, pos = batch.seq_index(), batch.positions
        rows = meta.rows[seq] if meta.rows is not None else seq
        index = self._flat(rows, pos)
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, index, x.to(pool.dtype))

    def decode_attention(self, layer: int, meta: Decode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         window: int | None = None) -> torch.Tensor:
        """Append one token per row (``q`` ``[B, H, D]``, rows ``meta.first_row ..``) and attend to its blocks."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        table = self.table[meta.first_row:meta.first_row + q.shape[0]]
        k_pool, v_pool = self.k[layer], self.v[layer]
        kernel = paged_kernel(q, self.block_tokens)
        match kernel:
            case "flash":
                return flash_decode(q, k_pool, v_pool, k, v, meta.lengths, scale, window, block_table=table)
            case "triton":
                self._write(k_pool, v_pool, k, v, self._write_index(meta, table))
                return paged_attention_triton.paged_decode_attention(q, k_pool, v_pool, table, meta.lengths, scale,
                                                                     window)
            case "gather":
                write, gather, mask = self._paged_index(meta, table, window, q.device)
                self._write(k_pool, v_pool, k, v, write)
                used = meta.longest + 1
                keys, values = ((pool[gather].flatten(1, 2)[:, :used]).transpose(1, 2) for pool in (k_pool, v_pool))
                return decode_sdpa(q, keys, values, mask, scale)
            case _:
                assert_never(kernel)

    @staticmethod
    def _write(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               write: torch.Tensor) -> None:
        """This step's keys/values into their flat pool positions ``write``."""
        for pool, x in ((k_pool, k), (v_pool, v)):
            pool.view(-1, *pool.shape[2:]).index_copy_(0, write, x.to(pool.dtype))

    def _write_index(self, meta: Decode, table: torch.Tensor) -> torch.Tensor:
        """This step's write index ``[B]``, made for the first layer and shared by the step's others."""
        key = (0, -1)  # beside rows_and_mask's (rows, window) and _paged_index's (-rows, window) entries
        if key not in meta.shared:
            rows = torch.arange(table.shape[0], device=table.device)
            meta.shared[key] = (self._flat(meta.first_row + rows, meta.lengths), rows)
        return meta.shared[key][0]

    def _paged_index(self, meta: Decode, table: torch.Tensor, window: int | None,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This step's write index ``[B]`` (flat pool positions of the new tokens), gather index ``[B, n]`` (each
        row's first ``n`` blocks, enough for ``longest + 1`` positions) and mask: made for the first layer, shared
        by the step's others (``meta.shared``)."""
        rows, mask = meta.rows_and_mask(table.shape[0], window, device)
        key = (-table.shape[0], window)  # beside rows_and_mask's (rows, window) entry
        if key not in meta.shared:
            blocks = blocks_for(meta.longest + 1, self.block_tokens)
            write = self._flat(meta.first_row + rows, meta.lengths)
            meta.shared[key] = (write, table[:, :blocks].long())
        write, gather = meta.shared[key]
        return write, gather, mask
