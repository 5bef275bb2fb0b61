import pytest
import torch

from restage.models.attention import Decode, KVCache, _sdpa_by_length, _sdpa_padded
from restage.models.packing import PackedBatch


@pytest.mark.parametrize("window", [None, 3])
def test_padded_and_per_length_sdpa_agree_with_gradients(window):
    torch.manual_seed(0)
    batch = PackedBatch.from_seqlens([5, 1, 7, 7, 3, 6])
    tokens = sum(batch.seqlens)
    q = torch.randn(tokens, 4, 8, requires_grad=True)
    k = torch.randn(tokens, 2, 8, requires_grad=True)
    v = torch.randn(tokens, 2, 8, requires_grad=True)
    grads = []
    outs = []
    for path in (_sdpa_padded, _sdpa_by_length):
        out = path(q, k, v, batch, 0.3, window)
        (out * torch.arange(out.numel()).reshape(out.shape).sin()).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _decode_reference(k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: list[int], q, k, v) -> torch.Tensor:
    """One decode step by hand: row b writes its new key/value at lengths[b] and attends to slots 0..lengths[b]."""
    out = []
    for b, n in enumerate(lengths):
        keys = torch.cat([k_cache[b, :n], k[b:b + 1]]).transpose(0, 1)  # [H, n + 1, D]
        values = torch.cat([v_cache[b, :n], v[b:b + 1]]).transpose(0, 1)
        weights = (q[b].unsqueeze(1) @ keys.transpose(1, 2) / q.shape[-1] ** 0.5).softmax(-1)  # [H, 1, n + 1]
        out.append((weights @ values).squeeze(1))
    return torch.stack(out)


def test_a_decode_step_shares_its_mask_over_layers_and_rebuilds_it_when_lengths_change():
    """The mask made by a step's first layer serves its other layers, and never a later step: each step's metadata
    (new lengths, lengths filled, or lengths grown in place) gives every layer the hand-computed answer."""
    torch.manual_seed(0)
    cache = KVCache(range(2), batch_size=3, max_len=8, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")
    for layer in range(2):
        cache.k[layer].normal_()
        cache.v[layer].normal_()

    def step(meta: Decode, lengths: list[int]) -> None:
        for layer in range(2):
            q, k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4), torch.randn(3, 2, 4)
            want = _decode_reference(cache.k[layer].clone(), cache.v[layer].clone(), lengths, q, k, v)
            torch.testing.assert_close(cache.decode_attention(layer, meta, q, k, v), want, rtol=1e-5, atol=1e-6)

    step(Decode(torch.tensor([2, 5, 0]), 5), [2, 5, 0])
    step(Decode(torch.tensor([3, 1, 6]), 6), [3, 1, 6])  # the same longest bound would serve; the mask must not
    lengths = torch.full((3,), 4)
    step(Decode(lengths, 4), [4, 4, 4])
    lengths += torch.tensor([1, 2, 1])
    step(Decode(lengths, 6), [5, 6, 5])
