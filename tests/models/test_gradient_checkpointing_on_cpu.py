"""Gradient checkpointing (``models.<m>.gradient_checkpointing``, ``StageModule.checkpoint_blocks``): a training
forward keeps each block's input only and recomputes the block in the backward, giving the very same gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from restage.errors import ConfigError
from restage.models.arch import ModelConfig
from restage.models.decoder import StageModule
from restage.models.packing import PackedBatch
from restage.models.parallel import ParallelContext

LLAMA = ModelConfig(family="llama", model_type="llama", vocab_size=40, hidden_size=64, intermediate_size=176,
                    num_layers=3, num_heads=8, num_kv_heads=2, max_positions=128)
QWEN3 = dataclasses.replace(LLAMA, model_type="qwen3", qk_norm=True, head_dim=24, num_heads=6, num_kv_heads=3)
SEQLENS = (17, 9, 24)


def _grads(cfg: ModelConfig, recompute: bool) -> tuple[dict[str, torch.Tensor], int, int]:
    """Each parameter's gradient of a log-prob loss, how many block forwards ran, and the bytes autograd saved outside
    the checkpointed blocks (parameters not counted)."""
    torch.manual_seed(0)
    module = StageModule(cfg, ParallelContext.single())
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    module.checkpoint_blocks(recompute)
    calls = [0]
    for block in module.layers.values():
        # a pre-hook: the recomputation stops once it has what the backward needs, before a forward hook would run
        block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    batch = PackedBatch.from_seqlens(SEQLENS)
    tokens = torch.randint(0, cfg.vocab_size, (batch.num_tokens,), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module.token_logprobs(module(tokens, batch), tokens, batch).sum()
    loss.backward()
    return {n: p.grad for n, p in module.named_parameters()}, calls[0], sum(saved.values())


@pytest.mark.parametrize("cfg", [LLAMA, QWEN3], ids=["llama", "qwen3"])
def test_recomputed_blocks_give_the_same_gradients_and_run_twice(cfg: ModelConfig):
    plain, plain_calls, plain_saved = _grads(cfg, recompute=False)
    again, again_calls, again_saved = _grads(cfg, recompute=True)
    assert plain.keys() == again.keys()
    for name in plain:
        assert torch.equal(plain[name], again[name]), name  # the same arithmetic, recomputed
    assert (plain_calls, again_calls) == (cfg.num_layers, 2 * cfg.num_layers)  # each block once more in the backward
    assert again_saved < plain_saved / 2  # the blocks' own activations are no longer held across the backward


def test_inference_and_generation_do_not_checkpoint(monkeypatch):
    """Without autograd (inference, generation) the blocks run plainly; with it, each block goes through checkpoint."""
    module = StageModule(LLAMA, ParallelContext.single())
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.05)
    module.checkpoint_blocks()
    wrapped = []
    original = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", lambda *a, **k: wrapped.append(1) or original(*a, **k))
    batch = PackedBatch.from_seqlens(SEQLENS)
    tokens = torch.zeros(batch.num_tokens, dtype=torch.int64)
    with torch.no_grad():
        module(tokens, batch)
    assert wrapped == []
    module(tokens, batch)
    assert len(wrapped) == LLAMA.num_layers


def test_a_mixture_of_experts_model_refuses_checkpointing_in_one_line():
    moe = dataclasses.replace(LLAMA, num_experts=4, experts_per_token=2, moe_intermediate_size=32, sparse_layers=(1,))
    module = StageModule(moe, ParallelContext.single())
    with pytest.raises(ConfigError, match="gradient_checkpointing: false"):
        module.checkpoint_blocks()
    module.checkpoint_blocks(False)  # turning it off is always allowed
