"""``Batch``: the packed form in which every MFC's inputs and outputs travel.

Sequences are concatenated with no padding. A key is either *per token* (``[T, ...]``,
``T = sum(seqlens)``, aligned with the packed tokens) or *per sequence* (``[n_seqs, ...]``).
``group_size`` consecutive sequences form one *sample* (a preference pair: 2, a GRPO group: G);
splitting, selecting and shuffling work on whole samples so a pair or a group never comes apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, assert_never

import torch

from restage.models.packing import contiguous_parts


@dataclass(frozen=True)
class Batch:
    seqlens: tuple[int, ...]
    tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    seqs: dict[str, torch.Tensor] = field(default_factory=dict)
    group_size: int = 1
    ids: tuple = ()  # one id per sample (dataset index), or empty

    def __post_init__(self) -> None:
        object.__setattr__(self, "seqlens", tuple(int(n) for n in self.seqlens))
        object.__setattr__(self, "ids", tuple(self.ids))
        if any(n <= 0 for n in self.seqlens):
            raise ValueError(f"every sequence needs at least one token, got lengths {self.seqlens}")
        if self.group_size < 1 or len(self.seqlens) % self.group_size:
            raise ValueError(f"{len(self.seqlens)} sequences do not split into groups of {self.group_size}")
        for key, value in self.tokens.items():
            if value.shape[0] != self.n_tokens:
                raise ValueError(f"per-token key {key!r} has {value.shape[0]} rows for {self.n_tokens} tokens")
        for key, value in self.seqs.items():
            if value.shape[0] != self.n_seqs:
                raise ValueError(f"per-sequence key {key!r} has {value.shape[0]} rows for {self.n_seqs} sequences")
        if key_clash := set(self.tokens) & set(self.seqs):
            raise ValueError(f"keys {sorted(key_clash)} are both per-token and per-sequence")
        if self.ids and len(self.ids) != self.n_samples:
            raise ValueError(f"{len(self.ids)} ids for {self.n_samples} samples")

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def n_seqs(self) -> int:
        return len(self.seqlens)

    @property
    def n_samples(self) -> int:
        return self.n_seqs // self.group_size

    @property
    def n_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """``[n_seqs + 1]`` int32 offsets of each sequence in the packed dimension, starting at 0."""
        cu = torch.zeros(self.n_seqs + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(self.seqlens, dtype=torch.int64), 0)
        device = next(iter(self.tokens.values())).device if self.tokens else None
        return cu.to(device)

    def sample_tokens(self) -> list[int]:
        g = self.group_size
        return [sum(self.seqlens[i * g:(i + 1) * g]) for i in range(self.n_samples)]

    # -- keys ------------------------------------------------------------------------------------
    def keys(self) -> tuple[str, ...]:
        return (*self.tokens, *self.seqs)

    def __contains__(self, key: str) -> bool:
        return key in self.tokens or key in self.seqs

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.tokens:
            return self.tokens[key]
        if key in self.seqs:
            return self.seqs[key]
        raise KeyError(f"batch has no key {key!r}; it holds {list(self.keys())}")

    def with_keys(self, tokens: dict | None = None, seqs: dict | None = None, **changes) -> Batch:
        """A new batch with these per-token / per-sequence keys added or replaced (and fields changed)."""
        return replace(self, tokens={**self.tokens, **(tokens or {})}, seqs={**self.seqs, **(seqs or {})}, **changes)

    def only(self, keys: Sequence[str]) -> Batch:
        """The same sequences with only ``keys`` kept."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no keys {missing}; it holds {list(self.keys())}")
        return replace(self, tokens={k: v for k, v in self.tokens.items() if k in keys},
                       seqs={k: v for k, v in self.seqs.items() if k in keys})

    def renamed(self, mapping: dict[str, str]) -> Batch:
        """The same batch with keys renamed (``{"greedy_seqs": "seqs"}``); unnamed keys keep their names."""
        return replace(self, tokens={mapping.get(k, k): v for k, v in self.tokens.items()},
                       seqs={mapping.get(k, k): v for k, v in self.seqs.items()})

    def to(self, device) -> Batch:
        return replace(self, tokens={k: v.to(device) for k, v in self.tokens.items()},
                       seqs={k: v.to(device) for k, v in self.seqs.items()})

    # -- selecting and splitting --------------------------------------------------------------------
    def select_seqs(self, seq_indices: Sequence[int], group_size: int = 1, ids: Sequence = ()) -> Batch:
        """The sequences at ``seq_indices`` (in that order), regrouped by ``group_size``."""
        index = [int(i) for i in seq_indices]
        cu = [0]
        for n in self.seqlens:
            cu.append(cu[-1] + n)
        token_index = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in index]) if index else torch.zeros(0, dtype=torch.long)
        seq_index = torch.tensor(index, dtype=torch.long)
        return Batch(tuple(self.seqlens[i] for i in index),
                     {k: v[token_index.to(v.device)] for k, v in self.tokens.items()},
                     {k: v[seq_index.to(v.device)] for k, v in self.seqs.items()}, group_size, tuple(ids))

    def select(self, sample_indices: Sequence[int]) -> Batch:
        """The samples at ``sample_indices`` (whole groups), in that order."""
        g = self.group_size
        seq_indices = [i * g + j for i in sample_indices for j in range(g)]
        ids = tuple(self.ids[i] for i in sample_indices) if self.ids else ()
        return self.select_seqs(seq_indices, g, ids)

    def split(self, n_parts: int, balance: Literal["tokens", "samples"] = "tokens") -> list[Batch]:
        """Contiguous parts of whole samples, each non-empty, of about equal tokens or samples.

        Asking for more parts than samples gives one part per sample.
        """
        match balance:
            case "tokens":
                weights = self.sample_tokens()
            case "samples":
                weights = [1] * self.n_samples
            case unknown:
                assert_never(unknown)
        return [self.select(part) for part in contiguous_parts(weights, n_parts)]


def concat(batches: Sequence[Batch]) -> Batch:
    """One batch holding the samples of ``batches`` in order (same keys and group size in all)."""
    if not batches:
        raise ValueError("concat needs at least one batch")
    first = batches[0]
    for b in batches[1:]:
        if set(b.tokens) != set(first.tokens) or set(b.seqs) != set(first.seqs) or b.group_size != first.group_size:
            raise ValueError(f"cannot concat batches with keys {sorted(first.keys())} (group {first.group_size}) and "
                             f"{sorted(b.keys())} (group {b.group_size})")
    has_ids = all(b.ids for b in batches)
    return Batch(tuple(n for b in batches for n in b.seqlens),
                 {k: torch.cat([b.tokens[k] for b in batches]) for k in first.tokens},
                 {k: torch.cat([b.seqs[k] for b in batches]) for k in first.seqs},
                 first.group_size, tuple(i for b in batches for i in b.ids) if has_ids else ())


def pack_sequences(seqs: Sequence[Sequence[int] | torch.Tensor], group_size: int = 1, key: str = "seqs",
                   prompt_lens: Sequence[int] | None = None, ids: Sequence = ()) -> Batch:
    """A batch of token-id sequences under ``key``; with ``prompt_lens``, also ``prompt_mask`` (1 on prompt tokens)."""
    tensors = [torch.as_tensor(s, dtype=torch.long) for s in seqs]
    lengths = [t.numel() for t in tensors]
    tokens = {key: torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.long)}
    if prompt_lens is not None:
        tokens["prompt_mask"] = torch.cat([torch.arange(n) < p for n, p in zip(lengths, prompt_lens)])
    return Batch(tuple(lengths), tokens, {}, group_size, tuple(ids))
