"""Named architectures for planning without a checkpoint (``models.<name>.arch: llama-7b``).

The LLaMA shapes are those of the published LLaMA-2 (7B, 13B, 70B) and Code Llama (34B) configs;
the Qwen3, Llama 3.x and mixture-of-experts (Mixtral-8x7B, Qwen3-30B-A3B) ones are the fields of each
model's published ``config.json`` on the HF hub (cited beside it), read by ``ModelConfig.from_hf_dict`` as a
checkpoint's would be; the tiny ones are for tests and CPU runs. A critic or reward model is the same backbone
with a scalar head (``critic=True``).
"""

from __future__ import annotations

from restage.errors import ConfigError
from restage.models.arch import ModelConfig


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int = 32000,
           positions: int = 4096, rope_theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(family="llama", model_type="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       max_positions=positions, norm_eps=1e-5, rope_theta=rope_theta, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tied, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
    }, source="preset")


# Llama 3.1 (and 3.2's) RoPE: rope_scaling of the published configs (factor 8 for 3.1, 32 for 3.2).
def _llama3(hidden: int, inter: int, layers: int, heads: int, tied: bool = False, factor: float = 8.0) -> ModelConfig:
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": tied,
        "rope_scaling": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": 128001,
    }, source="preset")


# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (intermediate_size is each expert's).
_MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6,
    "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "router_aux_loss_coef": 0.001, "use_sliding_window": False,
    "tie_word_embeddings": False, "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645,
}


PRESETS: dict[str, ModelConfig] = {
    "llama-7b": _llama(4096, 11008, 32, 32, 32),
    "llama-13b": _llama(5120, 13824, 40, 40, 40),
    "llama-34b": _llama(8192, 22016, 48, 64, 8, positions=16384, rope_theta=1e6),
    "llama-70b": _llama(8192, 28672, 80, 64, 8),
    # https://huggingface.co/Qwen/Qwen3-<size>/blob/main/config.json (head_dim 128, 8 KV heads, all sizes)
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (and -70B, -405B alike)
    "llama-3.1-8b": _llama3(4096, 14336, 32, 32),
    "llama-3.1-70b": _llama3(8192, 28672, 80, 64),
    "llama-3.1-405b": _llama3(16384, 53248, 126, 128),
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json (and -3B): tied, RoPE factor 32
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, tied=True, factor=32.0),
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, tied=True, factor=32.0),
    # Small shapes for tests and CPU runs (vocabularies fit the test tokenizers' id range).
    "llama-tiny": _llama(64, 172, 2, 4, 2, vocab=512, positions=512),
    "llama-small": _llama(256, 688, 4, 8, 4, vocab=2048, positions=1024),
    "llama-1b": _llama(2048, 5504, 22, 32, 4, positions=2048),
    # Mixtures of experts.
    "mixtral-8x7b": ModelConfig.from_hf_dict(_MIXTRAL_8X7B, source="preset"),
    "qwen3-30b-a3b": ModelConfig.from_hf_dict(_QWEN3_30B_A3B, source="preset"),
}


def preset(name: str, critic: bool = False) -> ModelConfig:
    """The architecture called ``name``; with ``critic`` its scalar-head variant."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ConfigError(f"architecture preset {name!r} is unknown; use one of {', '.join(PRESETS)}") from None
    return cfg.as_critic() if critic else cfg
