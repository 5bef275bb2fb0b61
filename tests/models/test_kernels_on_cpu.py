"""Packing, varlen attention, the KV cache and vocabulary-parallel losses against plain PyTorch (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from restage.models.attention import Decode, KVCache, Prefill, varlen_attention
from restage.models.packing import PackedBatch, pack, split_micro_batches, unpack
from restage.models.parallel import ParallelContext, vocab_parallel_entropy, vocab_parallel_logprobs


def naive_attention(q, k, v, window=None):
    """One sequence, ``[L, H, D]``, written out with an explicit causal (and window) mask."""
    length, heads, dim = q.shape
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    i = torch.arange(length)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed &= i[:, None] - i[None, :] < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_packed_positions_restart_per_sequence():
    tokens, batch = pack([[5, 6, 7], [8], [9, 10]])
    assert tokens.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.cu_seqlens.tolist() == [0, 3, 4, 6] and batch.max_seqlen == 3
    assert batch.positions.tolist() == [0, 1, 2, 0, 0, 1]
    assert batch.seq_index().tolist() == [0, 0, 0, 1, 2, 2]
    assert [t.tolist() for t in unpack(tokens, batch)] == [[5, 6, 7], [8], [9, 10]]
    assert PackedBatch.from_seqlens([2, 1], start_positions=[4, 7]).positions.tolist() == [4, 5, 7]


def test_micro_batches_cover_every_sequence_once():
    seqs = [[0] * n for n in (5, 1, 7, 3, 3, 9, 2)]
    groups = split_micro_batches(seqs, 3)
    assert len(groups) == 3 and sorted(i for g in groups for i in g) == list(range(len(seqs)))
    assert split_micro_batches(seqs[:2], 5) == [[0], [1]]


@pytest.mark.parametrize("window", [None, 4])
def test_varlen_attention_equals_per_sequence_attention(window):
    torch.manual_seed(0)
    lengths = [5, 9, 5, 1, 12]
    _, batch = pack([[0] * n for n in lengths])
    q, k, v = torch.randn(sum(lengths), 4, 8), torch.randn(sum(lengths), 2, 8), torch.randn(sum(lengths), 2, 8)
    out = varlen_attention(q, k, v, batch, window)
    for (qs, ks, vs, os) in zip(*(unpack(t, batch) for t in (q, k, v, out))):
        assert torch.allclose(os, naive_attention(qs, ks, vs, window), atol=1e-6)


def test_kv_cache_decoding_equals_attention_over_the_whole_sequence():
    torch.manual_seed(1)
    prompt_lengths, steps = [3, 6], 4
    full = [n + steps for n in prompt_lengths]
    q, k, v = ([torch.randn(n, 4, 8) for n in full] for _ in range(3))
    cache = KVCache([0], batch_size=2, max_len=max(full), kv_heads=4, head_dim=8, dtype=torch.float32, device=None)
    _, prefill = pack([[0] * n for n in prompt_lengths])
    cache.prefill(0, Prefill(), prefill, torch.cat([t[:n] for t, n in zip(k, prompt_lengths)]),
                  torch.cat([t[:n] for t, n in zip(v, prompt_lengths)]))
    for step in range(steps):
        pos = [n + step for n in prompt_lengths]
        out = cache.decode_attention(0, Decode(torch.tensor(pos), max(pos)), torch.stack([t[p] for t, p in zip(q, pos)]),
                                     torch.stack([t[p] for t, p in zip(k, pos)]), torch.stack([t[p] for t, p in zip(v, pos)]))
        for b in range(2):
            expected = naive_attention(q[b][: pos[b] + 1], k[b][: pos[b] + 1], v[b][: pos[b] + 1])[-1]
            assert torch.allclose(out[b], expected, atol=1e-6)


def test_vocab_parallel_logprobs_and_entropy_equal_log_softmax_with_gradients():
    torch.manual_seed(2)
    ctx = ParallelContext.single()
    logits = torch.randn(6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    ours = vocab_parallel_logprobs(logits, targets, ctx, vocab_start=0, temperature=0.7)
    entropy = vocab_parallel_entropy(logits, ctx, temperature=0.7)
    (ours.sum() + entropy.sum()).backward()
    grad_ours, logits.grad = logits.grad.clone(), None
    logp = (logits / 0.7).log_softmax(-1)
    expected = logp.gather(-1, targets[:, None]).squeeze(-1)
    expected_entropy = -(logp.exp() * logp).sum(-1)
    (expected.sum() + expected_entropy.sum()).backward()
    assert torch.allclose(ours, expected, atol=1e-6) and torch.allclose(entropy, expected_entropy, atol=1e-6)
    assert torch.allclose(grad_ours, logits.grad, atol=1e-6)
