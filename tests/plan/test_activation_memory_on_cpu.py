"""The estimator's activation bytes (``plan/activations.py``) against what restage's decoder really saves for its
backward pass: ``torch.autograd.graph.saved_tensors_hooks`` around a real forward, each saved storage counted once,
parameters (and views of them) not at all."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from restage.layout import Layout, ProcessGroups, Strategy
from restage.models.arch import ModelConfig
from restage.models.decoder import StageModule
from restage.models.packing import PackedBatch
from restage.models.parallel import ParallelContext
from restage.models.rope import rope_tables
from restage.plan.activations import (
    FP32_BYTES,
    INDEX_BYTES,
    block_activation_bytes_per_token,
    forward_activation_bytes_per_token,
    head_activation_bytes_per_token,
)
from restage.runtime.control.spawn import spawn

LLAMA = ModelConfig(family="llama", model_type="llama", vocab_size=40, hidden_size=64, intermediate_size=176,
                    num_layers=2, num_heads=8, num_kv_heads=2, max_positions=128)
QWEN3 = dataclasses.replace(LLAMA, model_type="qwen3", qk_norm=True, head_dim=24, num_heads=6, num_kv_heads=3,
                            intermediate_size=96)
MHA = dataclasses.replace(LLAMA, num_kv_heads=8, hidden_size=48, intermediate_size=128)
GPT2 = ModelConfig(family="gpt2", model_type="gpt2", vocab_size=40, hidden_size=64, intermediate_size=256, num_layers=2,
                   num_heads=4, num_kv_heads=4, max_positions=128, qkv_bias=True, o_bias=True, tied_embeddings=True)
DTYPES = {2: torch.bfloat16, 4: torch.float32}
SEQLENS = (24, 24, 24)  # equal lengths: attention's SDPA path by length (the padded path is documented as not counted)


def saved_bytes(module: torch.nn.Module, forward) -> int:
    """Bytes of the distinct storages autograd saves while ``forward()`` runs, less the module's parameters'."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(storages.values())


def build(cfg: ModelConfig, e: int, ctx: ParallelContext) -> StageModule:
    torch.manual_seed(0)
    module = StageModule(cfg, ctx, DTYPES[e])
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return module


def block_bytes(module: StageModule, layer: int = 0) -> int:
    """What block ``layer`` alone saves in a forward over ``SEQLENS``."""
    cfg = module.cfg
    batch = PackedBatch.from_seqlens(SEQLENS)
    h = torch.randn(batch.num_tokens, cfg.hidden_size, dtype=module.dtype, requires_grad=True)
    rope = None if cfg.family == "gpt2" else rope_tables(batch.positions, cfg.head_dim, cfg.rope_theta, module.dtype)
    return saved_bytes(module, lambda: module.layers[str(layer)](h, batch, rope, None, None))


def cpu_norm_statistics_difference(cfg: ModelConfig, e: int) -> int:
    """A CPU's LayerNorm keeps its mean and reciprocal deviation in the model's dtype, CUDA's (what the formula
    counts) in fp32: the bytes per token per norm a CPU saves less."""
    return 2 * (FP32_BYTES - e) if cfg.family == "gpt2" else 0


@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("cfg", [LLAMA, QWEN3, MHA, GPT2], ids=["llama-gqa", "qwen3-qk-norm", "llama-mha", "gpt2"])
def test_block_saves_exactly_the_formula(cfg: ModelConfig, e: int):
    """One block's forward (it also saves RoPE's tables, the per-forward term less the embedding's ids)."""
    rope = forward_activation_bytes_per_token(cfg, e) - INDEX_BYTES
    expected = block_activation_bytes_per_token(cfg, 1, e) + rope - 2 * cpu_norm_statistics_difference(cfg, e)
    assert block_bytes(build(cfg, e, ParallelContext.single())) == expected * sum(SEQLENS)


@pytest.mark.parametrize("e", [2, 4])
@pytest.mark.parametrize("cfg", [LLAMA, QWEN3, GPT2, dataclasses.replace(LLAMA, is_critic=True)],
                         ids=["llama", "qwen3", "gpt2", "llama-critic"])
def test_whole_stage_saves_embedding_blocks_and_head(cfg: ModelConfig, e: int):
    """Embedding, every block, the final norm and the head with ``token_logprobs`` (an LM) or the values (a critic):
    the per-forward, per-block and head terms, plus the one int64 per sequence ``token_logprobs`` keeps."""
    module = build(cfg, e, ParallelContext.single())
    batch = PackedBatch.from_seqlens(SEQLENS)
    ids = torch.randint(0, cfg.vocab_size, (batch.num_tokens,))

    def forward():
        out = module(ids, batch)
        return out if cfg.is_critic else module.token_logprobs(out, ids, batch)

    per_token = (forward_activation_bytes_per_token(cfg, e) + cfg.num_layers * block_activation_bytes_per_token(cfg, 1, e)
                 + head_activation_bytes_per_token(cfg, 1, e)
                 - (2 * cfg.num_layers + 1) * cpu_norm_statistics_difference(cfg, e))
    per_sequence = 0 if cfg.is_critic else INDEX_BYTES
    if cfg.family == "gpt2":
        # GPT-2 adds learned positions: F.embedding saves the int64 positions (not the ids' storage).
        per_token += INDEX_BYTES
    assert saved_bytes(module, forward) == per_token * batch.num_tokens + per_sequence * len(SEQLENS)


def _tp_block_bytes(rank: int, world_size: int, cfg: ModelConfig, e: int) -> int:
    layout = Layout(tuple(range(world_size)), Strategy(tp=world_size))
    ctx = ParallelContext.from_layout(layout, ProcessGroups(layout.all_groups()), rank)
    return block_bytes(build(cfg, e, ctx))


@pytest.mark.multirank
def test_tp2_shard_saves_the_formula_of_its_largest_chunk():
    """Two gloo ranks, a TP 2 shard each: the first (the largest MLP chunk of an odd width) saves exactly the
    formula at tp 2, the second one MLP column less (four saved values of it per token)."""
    cfg = dataclasses.replace(LLAMA, intermediate_size=177)
    first, second = spawn(_tp_block_bytes, 2, cfg, 2, timeout_seconds=300)
    tokens, rope = sum(SEQLENS), forward_activation_bytes_per_token(cfg, 2) - INDEX_BYTES
    assert first == (block_activation_bytes_per_token(cfg, 2, 2) + rope) * tokens
    assert second == (block_activation_bytes_per_token(cfg, 2, 2) + rope - 4 * 2) * tokens
