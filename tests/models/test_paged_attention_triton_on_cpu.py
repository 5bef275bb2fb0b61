"""The Triton paged decode-attention kernel (``rollout/paged_attention_triton.py``) under Triton's interpreter on
CPU, in fp32 (the interpreter's half-precision ``tl.dot`` is not the GPU's): against SDPA over the very positions
(GQA 1 and 4, head dims 16/32/64, blocks of 8/16/24/32 so tiles of 32 cross block edges, rows sharing prefix
blocks, unused table entries at a NaN scratch block, sliding windows), against the gather path through the cache,
and greedy generation with the kernel forced gives the contiguous cache's tokens. The GPU's bf16/fp32 and CUDA-graph
checks are in ``test_decode_graphs_on_gpu.py``."""

from __future__ import annotations

import math
import subprocess
import sys
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from model_cases import sample_sequences

from restage.layout import Layout, Strategy
from restage.models.attention import Decode
from restage.models.hf_checkpoint import load_stage
from restage.models.tiny import build_tiny
from restage.rollout import paged_attention_triton, paged_cache
from restage.rollout.budget import RolloutLimits
from restage.rollout.generation import generate
from restage.rollout.paged_attention_triton import paged_decode_attention
from restage.rollout.paged_cache import PagedKVCache
from restage.rollout.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not paged_attention_triton.triton_installed(),
                                reason="triton is not installed (pip install triton; the test extra has it)")

TOL = 1e-5


def _triton_modules() -> dict[str, ModuleType]:
    """triton's Python modules now imported (its compiled library, ``triton._C``, is loaded once and kept)."""
    return {name: module for name, module in sys.modules.items()
            if (name == "triton" or name.startswith("triton.")) and not name.startswith("triton._C")}


@pytest.fixture(scope="module", autouse=True)
def interpreted():
    """Triton's interpreter for this module's kernels. TRITON_INTERPRET must be set when triton is imported (its
    library's own jitted functions are built then), and another test may have imported it already: its modules are
    imported afresh here under the interpreter, and the session's put back after (nothing else runs interpreted)."""
    session = _triton_modules()
    for name in session:
        del sys.modules[name]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        paged_attention_triton._kernel.cache_clear()
        yield
    for name in _triton_modules():
        del sys.modules[name]
    sys.modules.update(session)
    paged_attention_triton._kernel.cache_clear()


def _pools(blocks: int, block_tokens: int, kv_heads: int, head_dim: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(blocks + 1, block_tokens, kv_heads, head_dim, generator=generator) for _ in range(2))
    k[blocks], v[blocks] = float("nan"), float("nan")  # scratch: read only if a mask is wrong
    return k, v


def _reference(q, k_pool, v_pool, table, lengths, scale, window):
    out = torch.empty_like(q)
    block_tokens = k_pool.shape[1]
    for b, length in enumerate(lengths.tolist()):
        pos = torch.arange(length + 1)
        if window is not None:
            pos = pos[max(0, length + 1 - window):]
        blocks = table[b, pos // block_tokens].long()
        keys, values = (pool[blocks, pos % block_tokens].transpose(0, 1) for pool in (k_pool, v_pool))  # [H_kv, n, D]
        out[b] = F.scaled_dot_product_attention(q[b].unsqueeze(1), keys, values, scale=scale,
                                                enable_gqa=True).squeeze(1)
    return out


# (GQA group, head dim, block tokens, window)
CASES = [(1, 16, 16, None), (4, 32, 32, None), (4, 64, 8, None), (1, 32, 24, 13), (4, 16, 24, 5), (4, 64, 16, 40)]


@pytest.mark.parametrize(("group", "head_dim", "block_tokens", "window"), CASES)
def test_kernel_equals_sdpa_over_the_rows_blocks(group, head_dim, block_tokens, window):
    kv_heads, blocks, max_blocks = 2, 12, 8
    k_pool, v_pool = _pools(blocks, block_tokens, kv_heads, head_dim, seed=head_dim + block_tokens)
    # Rows 0 and 1 share their first two blocks (a group's prompt); row 2 holds one block, row 3 one position.
    lengths = torch.tensor([3 * block_tokens + 5, 2 * block_tokens + 1, block_tokens - 2, 0])
    table = torch.full((4, max_blocks), blocks, dtype=torch.int32)
    table[0, :4] = torch.tensor([7, 2, 9, 4])
    table[1, :3] = torch.tensor([7, 2, 11])
    table[2, :1] = 5
    table[3, :1] = 0
    q = torch.randn(4, kv_heads * group, head_dim, generator=torch.Generator().manual_seed(1))
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_decode_attention(q, k_pool, v_pool, table, lengths, scale, window)
    expected = _reference(q, k_pool, v_pool, table, lengths, scale, window)
    assert out.isfinite().all()
    assert (out - expected).abs().max().item() < TOL


def _decode_step(cache: PagedKVCache, lengths: list[int], q, k, v, window):
    meta = Decode(torch.tensor(lengths), longest=max(lengths))
    return cache.decode_attention(0, meta, q, k, v, window)


@pytest.mark.parametrize("window", [None, 6])
def test_the_triton_path_through_the_cache_equals_the_gather_path(monkeypatch, window):
    generator = torch.Generator().manual_seed(3)
    rows, kv_heads, heads, head_dim, block_tokens = 3, 2, 4, 16, 8
    caches = [PagedKVCache([0], rows=rows, max_len=40, block_tokens=block_tokens, num_blocks=10, kv_heads=kv_heads,
                           head_dim=head_dim, dtype=torch.float32, device="cpu") for _ in range(2)]
    lengths = [19, 7, 12]
    for cache in caches:
        cache.hold(0, 20)
        cache.hold(1, 8, share_from=0, shared_tokens=8)  # one shared block
        cache.hold(2, 13)
        cache.flush()
        for pool in (cache.k[0], cache.v[0]):
            pool[:-1] = torch.randn(pool[:-1].shape, generator=torch.Generator().manual_seed(4))
    q, k, v = (torch.randn(rows, h, head_dim, generator=generator) for h in (heads, kv_heads, kv_heads))
    assert paged_cache.paged_kernel(q, block_tokens) == "gather"  # a CPU: the gather path
    gathered = _decode_step(caches[0], lengths, q, k, v, window)
    monkeypatch.setattr(paged_cache, "paged_kernel", lambda q, block_tokens: "triton")
    triton = _decode_step(caches[1], lengths, q, k, v, window)
    assert (triton - gathered).abs().max().item() < TOL
    assert torch.equal(caches[0].k[0], caches[1].k[0]) and torch.equal(caches[0].v[0], caches[1].v[0])  # same writes


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    root = tmp_path_factory.mktemp("triton_models")
    one_rank = Layout((0,), Strategy())
    return {name: load_stage(str(build_tiny(root / name, seed=i, **kwargs)), one_rank, None, 0)
            for i, (name, kwargs) in enumerate({"llama": dict(family="llama"),
                                                "mistral": dict(family="mistral", sliding_window=8)}.items())}


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_greedy_generation_on_the_triton_path_equals_the_contiguous_cache(stages, monkeypatch, name):
    module = stages[name]
    prompts = sample_sequences([6, 19, 11], seed=7)  # Mistral's window of 8 is passed by the longer rows
    params = SamplingParams(max_new_tokens=8, greedy=True)
    contiguous = generate(module, prompts, params, limits=RolloutLimits(max_slots=6, paged=False), group_size=2)
    served: list[str] = []
    monkeypatch.setattr(paged_cache, "paged_kernel", lambda q, block_tokens: served.append("triton") or "triton")
    paged = generate(module, prompts, params, limits=RolloutLimits(max_slots=6, paged=True), group_size=2)
    assert len(served) >= 4 * 7 and len(served) % 4 == 0  # each of the 4 layers, every decode step
    assert paged.sequences() == contiguous.sequences()
    torch.testing.assert_close(paged.logprobs, contiguous.logprobs, rtol=0, atol=TOL)


def test_without_triton_the_cache_imports_and_the_gather_path_serves():
    hide = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from restage.rollout import paged_attention_triton as t, paged_cache\n"
            "q = torch.zeros(2, 4, 32)\n"
            "print(t.triton_installed(), t.supports(torch.float32, 32), paged_cache.paged_kernel(q, 16))\n")
    done = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False", "gather"]
    assert paged_attention_triton.supports(torch.float32, 32) and paged_attention_triton.supports(torch.bfloat16, 128)
    assert not paged_attention_triton.supports(torch.float32, 24)  # Qwen3-like 24-wide heads: not a power of two
    assert not paged_attention_triton.supports(torch.float64, 32)
