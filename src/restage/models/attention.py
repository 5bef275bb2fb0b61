"""Causal attention over packed variable-length sequences, and the contiguous KV cache for generation (the paged
one is in ``paged_cache.py``).

Two real implementations, chosen per call at run time: flash-attn's varlen kernels when the
package imports and the tensors are fp16/bf16 on CUDA; PyTorch's scaled_dot_product_attention
otherwise. The SDPA path runs one call per distinct sequence length (sequences of equal length
are stacked), so no compute goes to padding.

Shapes: ``q`` is ``[T, H, D]``, ``k``/``v`` are ``[T, H_kv, D]`` (grouped-query attention when
``H_kv < H``).

A forward that uses a KV cache is handed its attention metadata (``Prefill`` or ``Decode``: the rows, lengths and
span of this step), built once per step by whoever owns the rows (the rollout engine); the cache itself only
stores keys and values and holds no per-step state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from restage.models.packing import PackedBatch

FlashFn = Callable[..., torch.Tensor]
try:  # optional: only on GPU machines with flash-attn installed
    from flash_attn import flash_attn_varlen_func as _varlen_kernel
    from flash_attn import flash_attn_with_kvcache as _kvcache_kernel
    flash_attn_varlen_func: FlashFn | None = _varlen_kernel
    flash_attn_with_kvcache: FlashFn | None = _kvcache_kernel
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = flash_attn_with_kvcache = None


def flash_installed() -> bool:
    """Whether flash-attn imports (its kernels then serve CUDA half-precision calls)."""
    return flash_attn_with_kvcache is not None


def use_flash(q: torch.Tensor) -> bool:
    """Whether flash-attn serves this call (installed, CUDA tensor, half precision)."""
    return flash_attn_varlen_func is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _window_pair(window: int | None) -> tuple[int, int]:
    # flash-attn's window is inclusive of the query position: left = window - 1 keeps `window` keys.
    return (-1, -1) if window is None else (window - 1, 0)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lengths: torch.Tensor, scale: float, window: int | None,
                 block_table: torch.Tensor | None = None) -> torch.Tensor:
    """flash-attn's decode kernel: append ``k``/``v`` (``[B, H_kv, D]``) at ``lengths`` in the cache (rows
    ``[B, L, H_kv, D]``, or a block pool read through ``block_table``) and attend ``q`` ``[B, H, D]`` to it."""
    assert flash_attn_with_kvcache is not None  # use_flash(q) checked it
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, k=k.unsqueeze(1), v=v.unsqueeze(1),
                                  cache_seqlens=lengths.to(torch.int32), block_table=block_table,
                                  softmax_scale=scale, causal=True, window_size=_window_pair(window))
    return out.squeeze(1)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch,
                     window: int | None = None) -> torch.Tensor:
    """Causal attention inside each packed sequence; returns ``[T, H, D]``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if use_flash(q):
        assert flash_attn_varlen_func is not None  # use_flash checked it
        cu = batch.cu_seqlens.to(device=q.device, dtype=torch.int32)
        out: torch.Tensor = flash_attn_varlen_func(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen,
                                                   softmax_scale=scale, causal=True, window_size=_window_pair(window))
        return out
    return _sdpa_varlen(q, k, v, batch, scale, window)


def _sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scale: float,
                 window: int | None) -> torch.Tensor:
    lengths = batch.seqlens
    # One padded call beats a call per distinct length while padding wastes little (short, similar
    # sequences: per-call overhead dominates); long sequences of mixed lengths go by length.
    if len(set(lengths)) > 1 and len(lengths) * batch.max_seqlen ** 2 <= 2 * sum(n * n for n in lengths):
        return _sdpa_padded(q, k, v, batch, scale, window)
    return _sdpa_by_length(q, k, v, batch, scale, window)


def _sdpa_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scale: float,
                 window: int | None) -> torch.Tensor:
    """All sequences in one ``[B, H, L_max, D]`` call; a mask hides the padding keys and the future."""
    # Index tensors come from the host lengths and go to the device without a sync; a boolean
    # mask index would make the host wait for the mask's count.
    padded = batch.max_seqlen
    offsets = torch.arange(padded)
    lengths = torch.tensor(batch.seqlens)
    starts = torch.tensor(_starts(batch.seqlens))
    valid_host = offsets.unsqueeze(0) < lengths.unsqueeze(1)  # [B, L]
    index = torch.where(valid_host, starts.unsqueeze(1) + offsets, 0).to(q.device, non_blocking=True)
    flat_valid = valid_host.reshape(-1).nonzero().squeeze(1).to(q.device, non_blocking=True)  # packed order rows
    valid = valid_host.to(q.device, non_blocking=True)
    qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))
    offsets = offsets.to(q.device, non_blocking=True)
    distance = offsets.unsqueeze(1) - offsets.unsqueeze(0)
    allowed = distance >= 0
    if window is not None:
        allowed = allowed & (distance < window)
    mask = (allowed.unsqueeze(0) & valid.unsqueeze(1)).unsqueeze(1)  # [B, 1, L, L]
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1])
    # row-major over (sequence, position) is the packed order
    return o.transpose(1, 2).reshape(-1, *q.shape[1:]).index_select(0, flat_valid)


def _starts(seqlens: Sequence[int]) -> list[int]:
    starts: list[int] = []
    start = 0
    for n in seqlens:
        starts.append(start)
        start += n
    return starts


def _sdpa_by_length(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch, scale: float,
                    window: int | None) -> torch.Tensor:
    out = torch.empty_like(q)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(_starts(batch.seqlens), batch.seqlens):
        by_length.setdefault(length, []).append(start)
    for length, group_starts in by_length.items():
        offsets = torch.arange(length)
        index = (torch.tensor(group_starts).unsqueeze(1) + offsets).reshape(-1).to(q.device, non_blocking=True)
        offsets = offsets.to(q.device, non_blocking=True)
        # [n, L, H, D] -> [n, H, L, D], the layout SDPA wants.
        qs, ks, vs = (t.index_select(0, index).view(len(group_starts), length, *t.shape[1:]).transpose(1, 2)
                      for t in (q, k, v))
        mask = None
        if window is not None and length > window:
            distance = offsets.unsqueeze(1) - offsets.unsqueeze(0)
            mask = (distance >= 0) & (distance < window)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=ks.shape[1] != qs.shape[1])
        out.index_copy_(0, index, o.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out


@dataclass(frozen=True)
class Prefill:
    """A forward that stores a packed batch's keys/values in cache rows (one sequence per row, at its positions)
    and attends within each sequence."""

    rows: torch.Tensor | None = None  # [B] cache row of each sequence (on the device); None: rows 0 .. B-1


@dataclass(frozen=True)
class Decode:
    """A forward of one new token per row of ``first_row .. first_row + B - 1``, attending to everything cached.

    Rows are left-aligned: row ``b`` holds ``lengths[b]`` tokens at positions ``0 .. lengths[b] - 1`` and this
    step's token goes to position ``lengths[b]``. ``longest`` bounds ``lengths.max()`` on the host (exact in
    generation), so attention spans keys ``0 .. longest`` without the host waiting for the device.
    """

    lengths: torch.Tensor  # [B] int64 on the device
    longest: int
    first_row: int = 0
    # What the step's layers share (the rows' write index, the attention mask), made by its first layer: one
    # object per step, so nothing made for an earlier step is ever read.
    shared: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False)

    def rows_and_mask(self, rows: int, window: int | None,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Row index ``[B]`` and attention mask ``[B, 1, 1, longest + 1]`` (a key is seen when its position is
        filled, within ``window``)."""
        key = (rows, window)
        if key not in self.shared:
            slots = torch.arange(self.longest + 1, device=device)
            mask = slots.unsqueeze(0) <= self.lengths.unsqueeze(1)
            if window is not None:
                mask &= slots.unsqueeze(0) > self.lengths.unsqueeze(1) - window
            self.shared[key] = (torch.arange(rows, device=device), mask[:, None, None, :])
        return self.shared[key]


# What a forward does with the KV cache; None where there is none (training, scoring).
AttentionMetadata = Prefill | Decode


class KVStore:
    """Keys and values of one stage's layers in ``num_rows`` rows of at most ``max_len`` positions; the metadata of
    each forward (``Prefill``, ``Decode``) says which rows it reads and writes. ``KVCache`` stores rows
    contiguously; ``rollout.paged_cache.PagedKVCache`` in blocks.

    The host-side hooks (``hold``, ``release``, ``move``, ``flush``) let the rollout engine treat both alike:
    a contiguous row always has room, so they do nothing there.
    """

    def __init__(self, num_rows: int, max_len: int):
        self.num_rows, self.max_len = num_rows, max_len

    # Host-side room management (the rollout engine's calls); a contiguous row holds max_len tokens from the start.
    def hold(self, row: int, tokens: int, share_from: int | None = None, shared_tokens: int = 0) -> bool:
        """Make row ``row`` able to hold ``tokens`` tokens; False (nothing taken) when there is no room now."""
        return True

    def release(self, row: int) -> None:
        """Row ``row``'s sequence left: what it held is free again."""

    def move(self, source: int, target: int, num_tokens: int) -> None:
        """Row ``source``'s first ``num_tokens`` keys/values now belong to row ``target`` (``source`` left empty)."""
        raise NotImplementedError

    def flush(self) -> None:
        """Bring the device's view of the rows' storage up to date with the host's (before a forward)."""

    # Device side, each storage its own.
    def prefill(self, layer: int, meta: Prefill, batch: PackedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a packed batch's keys/values (one sequence per cache row, at their positions)."""
        raise NotImplementedError

    def copy_prefix(self, source: int, targets: list[int], num_tokens: int) -> None:
        """Give rows ``targets`` the first ``num_tokens`` keys/values of row ``source`` (a prompt prefilled once)."""
        raise NotImplementedError

    def decode_attention(self, layer: int, meta: Decode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         window: int | None = None) -> torch.Tensor:
        """Append one token per row (``q`` ``[B, H, D]``) and attend to the cache; ``[B, H, D]``."""
        raise NotImplementedError


class KVCache(KVStore):
    """Keys and values of the layers one stage holds, ``[B, L_max, H_kv_local, D]`` per layer: row ``b`` is one
    contiguous block of ``L_max`` positions (see ``KVStore``)."""

    def __init__(self, layers: Iterable[int], batch_size: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str | None):
        super().__init__(batch_size, max_len)
        shape = (batch_size, max_len, kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers}

    def move(self, source: int, target: int, num_tokens: int) -> None:
        self.copy_prefix(source, [target], num_tokens)

    def prefill(self, layer: int, meta: Prefill, batch: PackedBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a packed batch's keys/values (one sequence per cache row, at their positions)."""
        seq, pos = batch.seq_index(), batch.positions
        if meta.rows is not None:
            seq = meta.rows[seq]
        self.k[layer][seq, pos] = k
        self.v[layer][seq, pos] = v

    def copy_prefix(self, source: int, targets: list[int], num_tokens: int) -> None:
        """Give rows ``targets`` the first ``num_tokens`` keys/values of row ``source`` (a prompt prefilled once)."""
        for cache in (*self.k.values(), *self.v.values()):
            cache[targets, :num_tokens] = cache[source, :num_tokens]

    def decode_attention(self, layer: int, meta: Decode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         window: int | None = None) -> torch.Tensor:
        """Append one token per row (``q`` ``[B, H, D]``) and attend to the cache; ``[B, H, D]``."""
        scale = 1.0 / math.sqrt(q.shape[-1])
        rows_used = slice(meta.first_row, meta.first_row + q.shape[0])
        k_cache, v_cache = self.k[layer][rows_used], self.v[layer][rows_used]  # views of B consecutive rows
        if use_flash(q):
            return flash_decode(q, k_cache, v_cache, k, v, meta.lengths, scale, window)
        rows, mask = meta.rows_and_mask(q.shape[0], window, q.device)
        k_cache[rows, meta.lengths] = k
        v_cache[rows, meta.lengths] = v
        used = meta.longest + 1  # only attend over slots some sequence has filled
        keys = k_cache[:, :used].transpose(1, 2)
        values = v_cache[:, :used].transpose(1, 2)
        return decode_sdpa(q, keys, values, mask, scale)


def decode_sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """One query per sequence (``q`` ``[B, H, D]``) against ``keys``/``values`` ``[B, H_kv, L, D]``; ``[B, H, D]``."""
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask,
                                         scale=scale, enable_gqa=keys.shape[1] != q.shape[1])
    squeezed: torch.Tensor = out.squeeze(2)
    return squeezed
