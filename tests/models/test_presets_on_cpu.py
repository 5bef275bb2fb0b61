"""The 2026 presets have their published sizes: parameter counts of the HF checkpoints, RoPE and head shapes."""

from __future__ import annotations

import pytest

from restage.errors import ConfigError
from restage.models.presets import preset
from restage.models.sharding import param_specs

# name -> parameters of the published checkpoint: the safetensors totals for Llama 3.x, the model
# cards' figure (to 0.1 B) for Qwen3.
PUBLISHED_PARAMS = {
    "llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496, "llama-3.1-405b": 405_853_388_800,
    "llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824,
    "qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9, "qwen3-14b": 14.8e9,
    "qwen3-32b": 32.8e9,
}


@pytest.mark.parametrize("name", PUBLISHED_PARAMS)
def test_preset_parameter_count_is_the_published_one(name):
    count = sum(spec.numel for spec in param_specs(preset(name)))
    published = PUBLISHED_PARAMS[name]
    if name.startswith("llama"):
        assert count == published
    else:
        assert abs(count - published) <= 0.05e9, f"{name}: {count / 1e9:.3f} B"


def test_qwen3_heads_are_128_wide_whatever_the_hidden_size():
    for name, hidden in (("qwen3-8b", 4096), ("qwen3-32b", 5120)):
        cfg = preset(name)
        assert cfg.hidden_size == hidden and cfg.head_dim == 128 and cfg.qk_norm
        assert cfg.num_heads * cfg.head_dim == {4096: 4096, 5120: 8192}[hidden]  # 32B's q is wider than hidden
    critic = preset("qwen3-8b", critic=True)
    assert critic.is_critic and critic.head_dim == 128 and critic.hf_architecture == "Qwen3ForSequenceClassification"


def test_llama31_presets_carry_the_llama3_rope():
    rope = preset("llama-3.1-70b").rope_scaling
    assert rope is not None and (rope.rope_type, rope.factor, rope.original_max_positions) == ("llama3", 8.0, 8192)
    assert preset("llama-3.1-70b").rope_theta == 500000.0 and preset("llama-3.1-70b").max_positions == 131072


def test_unknown_preset_lists_the_names():
    with pytest.raises(ConfigError, match="architecture preset 'qwen4-8b' is unknown; use one of .*qwen3-8b"):
        preset("qwen4-8b")
