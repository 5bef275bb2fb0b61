"""RoPE variants (models/rope.py) against transformers' own rotary embeddings, configs read in either format."""

from __future__ import annotations

import json
import math

import pytest
import torch
from model_cases import LLAMA31_ROPE, sample_sequences

from restage.errors import CheckpointError
from restage.layout import Layout, Strategy
from restage.models.arch import ModelConfig
from restage.models.hf_checkpoint import load_stage, save_checkpoint
from restage.models.packing import pack
from restage.models.rope import apply_rope_qk, inv_frequencies, rope_cos_sin, rope_tables

# A Llama-3.1-8B-shaped config.json as published (rope_scaling beside a top-level rope_theta), scaled down.
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 257, "hidden_size": 64,
         "intermediate_size": 171, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 256}
QWEN3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 24}
# name -> config.json. Old format: rope_scaling + rope_theta; transformers 5's: rope_parameters holding rope_theta.
CONFIGS = {
    "llama3_published_format": {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "llama3_rope_parameters": {**LLAMA, "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 10000.0}},
    "llama3_default_original_length": {**LLAMA, "rope_scaling": {
        "rope_type": "llama3", "factor": 2.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}},
    "linear_old_type_key": {**LLAMA, "rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 3.0}},
    "dynamic": {**LLAMA, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
    "yarn_qwen3": {**QWEN3, "rope_theta": 1000000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    "yarn_mscale_no_truncate": {**LLAMA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False, "beta_fast": 16, "beta_slow": 2}},
    "yarn_factor_from_lengths": {**LLAMA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 64}},
}


def _hf_rotary(hf: dict, tmp_path):
    from restage.models.tiny import quiet_transformers

    transformers = quiet_transformers()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    return transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb


@pytest.mark.parametrize("name", CONFIGS)
def test_cos_sin_equal_transformers_rotary_embedding_at_every_position(name, tmp_path):
    hf = CONFIGS[name]
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == name.split("_")[0]
    rotary = _hf_rotary(hf, tmp_path)
    positions = torch.arange(cfg.max_positions)
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.float32, cfg.rope_scaling)
    assert cos.shape == ref_cos[0].shape == (cfg.max_positions, cfg.head_dim)
    assert (cos - ref_cos[0]).abs().max().item() <= 1e-6 and (sin - ref_sin[0]).abs().max().item() <= 1e-6
    assert math.isclose(cfg.rope_scaling.attention_factor, rotary.attention_scaling, rel_tol=1e-12)


def test_the_llama31_fixture_uses_all_three_bands():
    cfg = ModelConfig.from_hf_dict({**LLAMA, "rope_parameters": {**LLAMA31_ROPE, "rope_theta": 10000.0}})
    default, scaled = inv_frequencies(16, 10000.0), inv_frequencies(16, 10000.0, cfg.rope_scaling)
    ratio = (default / scaled).tolist()
    assert ratio[0] == 1.0  # kept (wavelength 6 < 64 / 4)
    assert all(1.0 < r < 4.0 for r in ratio[1:3])  # blended (wavelengths 20 and 63)
    assert ratio[3:] == pytest.approx([4.0] * 5)  # divided by the factor (wavelengths 199 and longer)


def test_dynamic_ntk_is_the_default_rope_within_max_positions():
    cfg = ModelConfig.from_hf_dict(CONFIGS["dynamic"])
    assert torch.equal(inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                       inv_frequencies(cfg.head_dim, cfg.rope_theta))


@pytest.mark.parametrize("family,rope", [("qwen3", {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 32}),
                                         ("llama", {"rope_type": "linear", "factor": 2.5})])
def test_scaled_rope_logits_equal_transformers_and_a_save_reloads_to_the_same(family, rope, tmp_path):
    from restage.models.tiny import build_tiny, load_hf

    path = build_tiny(tmp_path / "model", family=family, rope_parameters=rope, head_dim=24 if family == "qwen3" else None)
    module = load_stage(path, Layout((0,), Strategy()), None, 0)
    seqs = sample_sequences([30, 12], seed=5)
    tokens, batch = pack(seqs)
    with torch.no_grad():
        ours = module(tokens, batch)
        reference = torch.cat([load_hf(path)(torch.tensor([s])).logits[0] for s in seqs])
    assert (ours - reference).abs().max().item() <= 1e-4
    save_checkpoint(module, tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_type"] == rope["rope_type"] and "rope_scaling" not in saved
    assert ModelConfig.from_pretrained(tmp_path / "saved") == module.cfg
    with torch.no_grad():
        again = torch.cat([load_hf(tmp_path / "saved")(torch.tensor([s])).logits[0] for s in seqs])
    assert (again - reference).abs().max().item() <= 1e-6


@pytest.mark.parametrize("change,expected", [
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
     "rope type 'longrope' is not supported; use one of default, linear, dynamic, llama3, yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope type 'llama3' needs 'low_freq_factor' in rope_scaling / rope_parameters; add it"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
    ({"model_type": "qwen3"}, "model_type 'qwen3' does not match architecture 'LlamaForCausalLM'; set model_type to "
                              "'llama'"),
    ({"model_type": "llama4_text"}, "model_type 'llama4_text' does not match architecture 'LlamaForCausalLM'; set "
                                    "model_type to 'llama' (supported: llama, mistral, qwen2, qwen3, gpt2)"),
])
def test_unsupported_rope_and_model_type_get_one_line_naming_what_to_change(change, expected):
    with pytest.raises(CheckpointError) as err:
        ModelConfig.from_hf_dict({**LLAMA, **change}, source="m")
    message = str(err.value)
    assert "\n" not in message and message.startswith("m: ") and expected in message


def test_queries_and_keys_rotated_together_equal_the_textbook_rotation_bit_for_bit():
    """``apply_rope_qk`` (one pass, negated sine) gives exactly ``x * cos + [-x2, x1] * sin`` for each of q and k."""
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 2, 7, 0, 3])
    q, k = torch.randn(6, 8, 16), torch.randn(6, 2, 16)
    cos, sin = rope_cos_sin(positions, 16, 10000.0, torch.float32)
    rq, rk = apply_rope_qk(q, k, rope_tables(positions, 16, 10000.0, torch.float32))
    for x, rotated in ((q, rq), (k, rk)):
        textbook = x * cos.unsqueeze(1) + torch.cat((-x[..., 8:], x[..., :8]), dim=-1) * sin.unsqueeze(1)
        assert torch.equal(rotated, textbook)
