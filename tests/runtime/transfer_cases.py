"""Batches whose every value follows from its sample id, and the producer/consumer layouts the tests walk."""

from __future__ import annotations

import random

import torch
from realloc_cases import L

from restage.data.batch import Batch, concat
from restage.runtime.dataplane.data_transfer import BatchMeta, KeySpec

KEYS = (
    KeySpec("seqs", True, "int64"),
    KeySpec("logprobs", True, "float32"),
    KeySpec("mask", True, "bool"),
    KeySpec("hidden", True, "bfloat16", (3,)),
    KeySpec("rewards", False, "float32"),
    KeySpec("pair", False, "int32", (2,)),
)


def sample_batch(sample_id: int, seqlens: tuple[int, ...], group_size: int) -> Batch:
    """One sample (``group_size`` sequences) whose values are a function of its id."""
    gen = torch.Generator().manual_seed(sample_id)
    tokens = sum(seqlens)
    return Batch(seqlens, {
        "seqs": sample_id * 1000 + torch.arange(tokens),
        "logprobs": torch.randn(tokens, generator=gen),
        "mask": torch.rand(tokens, generator=gen) > 0.5,
        "hidden": torch.randn(tokens, 3, generator=gen).to(torch.bfloat16),
    }, {
        "rewards": torch.randn(group_size, generator=gen),
        "pair": torch.full((group_size, 2), sample_id, dtype=torch.int32),
    }, group_size, (sample_id,))


def make_meta(seed: int, n_samples: int, producer_dp: int, group_size: int = 1) -> BatchMeta:
    """Random lengths, random ids, and samples dealt to producer DP ranks in a shuffled order."""
    rng = random.Random(seed)
    ids = tuple(rng.sample(range(10_000), n_samples))
    seqlens = tuple(rng.randint(1, 40) for _ in range(n_samples * group_size))
    order = list(range(n_samples))
    rng.shuffle(order)
    parts = [tuple(order[d::producer_dp]) for d in range(producer_dp)]
    return BatchMeta(ids, seqlens, group_size, KEYS, tuple(parts))


def producer_batch(meta: BatchMeta, part: int) -> Batch:
    samples = meta.producer_parts[part]
    return concat([sample_batch(meta.sample_ids[i], meta.sample_seqlens(i), meta.group_size) for i in samples])


# (producer, consumer, consumer pipeline stages that receive, samples, group size, what it covers)
TRANSFERS_8 = [
    (L(range(4), dp=4), L(range(4, 8), dp=2, tp=2), None, 13, 1, "disjoint, dp 4 -> 2 with tp"),
    (L(range(8), dp=8), L(range(8), dp=2, tp=2, pp=2), (0,), 21, 1, "same ranks, first stage only"),
    (L(range(8), dp=2, tp=4), L(range(8), dp=8), None, 17, 2, "tp replicas -> dp 8, pairs"),
    (L(range(2), dp=2), L(range(8), dp=4, pp=2), None, 9, 1, "nested, every stage receives"),
    (L((7, 5, 3, 1), dp=2, pp=2), L((0, 2, 4, 6), dp=4), None, 11, 3, "interleaved meshes, groups of 3"),
    (L(range(6), dp=3, tp=2), L(range(2, 8), dp=3, tp=2), (0,), 3, 1, "shifted, as many samples as ranks"),
    (L(range(4), dp=4), L(range(4), dp=4), None, 8, 1, "same layout, nothing moves"),
    (L((0,)), L(range(8), dp=8), None, 5, 1, "fewer samples than consumer ranks"),
]
