"""models/family.py: one description per family, and the names and shapes read from it."""

from __future__ import annotations

import dataclasses

import pytest

from restage.models.arch import ModelConfig
from restage.models.family import ARCHITECTURES, FAMILIES
from restage.models.hf_adapter import hf_source
from restage.models.sharding import param_specs

BASE = dict(vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=2,
            max_positions=32)


def _cfg(model_type: str, **kw: object) -> ModelConfig:
    family = FAMILIES[model_type]
    return ModelConfig(**{**BASE, "family": family.backbone, "model_type": model_type, **kw})


def test_every_supported_architecture_is_named_once_and_maps_back_to_its_family():
    assert sorted(ARCHITECTURES) == sorted(
        [f"{name}ForCausalLM" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral", "Qwen3Moe")]
        + ["GPT2LMHeadModel"]
        + [f"{name}ForSequenceClassification" for name in ("Llama", "Mistral", "Qwen2", "Qwen3", "Mixtral",
                                                           "Qwen3Moe", "GPT2")])
    for arch, (family, critic) in ARCHITECTURES.items():
        assert family.hf_architecture(critic) == arch


def test_hf_names_per_family():
    llama, gpt2 = _cfg("llama"), _cfg("gpt2", qkv_bias=True, o_bias=True)
    assert hf_source(llama, "layers.0.attn.q.weight").key == "model.layers.0.self_attn.q_proj.weight"
    assert hf_source(llama, "final_norm.weight").key == "model.norm.weight"
    k = hf_source(gpt2, "layers.0.attn.k.weight")
    assert (k.key, k.transpose, k.offset, k.fused) == ("transformer.h.0.attn.c_attn.weight", True, 16, True)
    bias = hf_source(gpt2, "layers.0.attn.v.bias")
    assert (bias.key, bias.transpose, bias.offset) == ("transformer.h.0.attn.c_attn.bias", False, 32)
    up = hf_source(gpt2, "layers.0.mlp.up.weight")
    assert (up.key, up.transpose, up.fused) == ("transformer.h.0.mlp.c_fc.weight", True, False)
    assert not hf_source(gpt2, "layers.0.mlp.up.bias").transpose
    moe = dict(num_experts=2, experts_per_token=1, moe_intermediate_size=8, sparse_layers=(0,))
    assert hf_source(_cfg("mixtral", **moe), "layers.0.mlp.experts.1.up.weight").key == (
        "model.layers.0.block_sparse_moe.experts.1.w3.weight")
    assert hf_source(_cfg("qwen3_moe", **moe), "layers.0.mlp.router.weight").key == "model.layers.0.mlp.gate.weight"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_blocks_parameters_follow_its_family(model_type: str):
    family = FAMILIES[model_type]
    names = {s.name for s in param_specs(_cfg(model_type, qk_norm=family.qk_norm))}
    assert ("pos_embed.weight" in names) == (family.positions == "learned")
    assert ("layers.0.attn_norm.bias" in names) == ("final_norm.bias" in names) == family.norm_bias
    assert ("layers.0.mlp.gate.weight" in names) == family.gated_mlp
    assert ("layers.0.mlp.up.bias" in names) == family.mlp_bias
    assert ("layers.0.attn.q_norm.weight" in names) == family.qk_norm


def test_a_backbone_that_does_not_match_the_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'gpt2' with family 'llama'"):
        dataclasses.replace(_cfg("llama"), model_type="gpt2")
