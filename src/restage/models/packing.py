"""Packed variable-length batches: sequences concatenated, no padding anywhere.

``tokens`` is ``[T]`` with ``T`` the total length; sequence ``b`` is
``tokens[cu_seqlens[b]:cu_seqlens[b+1]]`` and its positions restart at 0 (or continue from a
KV cache during generation).
"""

from __future__ import annotations

from collections.abc import Sequence, Sized
from dataclasses import dataclass

import torch
from torch.types import Device


@dataclass(frozen=True)
class PackedBatch:
    """Attention metadata of a packed batch (the tokens or hidden states travel separately).

    The lengths are kept on the host too (``seqlens``): reading them from the device tensors would
    make the host wait for the GPU in every layer.
    """

    cu_seqlens: torch.Tensor  # [B + 1] int32, starts at 0
    positions: torch.Tensor  # [T] int64, position of each token inside its sequence
    max_seqlen: int
    seqlens: tuple[int, ...]  # host copy of cu_seqlens' differences

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.positions.numel()

    def seq_index(self) -> torch.Tensor:
        """``[T]`` index of the sequence each token belongs to (its size given, so no device sync)."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=lengths.device), lengths.long(),
                                       output_size=self.num_tokens)

    def last_token_index(self) -> torch.Tensor:
        """``[B]`` index of every sequence's last token in the packed dimension."""
        return self.cu_seqlens[1:].long() - 1

    def to(self, device: Device) -> PackedBatch:
        return PackedBatch(self.cu_seqlens.to(device), self.positions.to(device), self.max_seqlen, self.seqlens)

    @classmethod
    def from_seqlens(cls, seqlens: Sequence[int], device: Device = None,
                     start_positions: Sequence[int] | None = None) -> PackedBatch:
        """Metadata for sequences of these lengths; positions start at ``start_positions`` (default 0)."""
        host = tuple(int(n) for n in seqlens)
        if min(host, default=0) <= 0:
            raise ValueError(f"every packed sequence needs at least one token, got lengths {list(seqlens)}")
        lengths = torch.tensor(host, dtype=torch.int64)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        starts = torch.repeat_interleave(cu[:-1].long(), lengths)
        positions = torch.arange(int(cu[-1])) - starts
        if start_positions is not None:
            positions = positions + torch.repeat_interleave(torch.tensor(list(start_positions)), lengths)
        return cls(cu.to(device), positions.to(device), max(host), host)

    @classmethod
    def decode_step(cls, positions: torch.Tensor) -> PackedBatch:
        """One new token per sequence at ``positions`` (``[B]``, on the device): a decoding step's metadata."""
        batch_size = positions.numel()
        cu = torch.arange(batch_size + 1, dtype=torch.int32, device=positions.device)
        return cls(cu, positions, 1, (1,) * batch_size)


def pack(seqs: Sequence[Sequence[int]] | Sequence[torch.Tensor], device: Device = None
         ) -> tuple[torch.Tensor, PackedBatch]:
    """Concatenate token sequences: ``(tokens [T] int64, PackedBatch)``."""
    tensors = [torch.as_tensor(s, dtype=torch.int64) for s in seqs]
    batch = PackedBatch.from_seqlens([t.numel() for t in tensors], device=device)
    return torch.cat(tensors).to(device), batch


def unpack(values: torch.Tensor, batch: PackedBatch) -> list[torch.Tensor]:
    """Split a packed ``[T, ...]`` tensor back into one tensor per sequence."""
    return list(torch.split(values, list(batch.seqlens)))


def contiguous_parts(weights: Sequence[int], n_parts: int) -> list[list[int]]:
    """Indices ``0..len(weights)-1`` cut into at most ``n_parts`` non-empty runs of near-equal total weight."""
    n = max(1, min(n_parts, len(weights)))
    parts: list[list[int]] = []
    current: list[int] = []
    total, acc = sum(weights), 0
    for i, weight in enumerate(weights):
        current.append(i)
        acc += weight
        parts_left, items_left = n - len(parts) - 1, len(weights) - i - 1
        if parts_left > 0 and (acc >= total * (len(parts) + 1) / n or items_left == parts_left):
            parts.append(current)
            current = []
    if current:
        parts.append(current)
    return parts


def split_micro_batches(seqs: Sequence[Sized], n_micro_batches: int) -> list[list[int]]:
    """Indices of ``seqs`` in ``n`` contiguous groups of near-equal token count (each non-empty)."""
    return contiguous_parts([len(s) for s in seqs], n_micro_batches)
