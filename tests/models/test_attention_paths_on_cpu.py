import pytest
import torch

from restage.models.attention import _sdpa_by_length, _sdpa_padded
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
