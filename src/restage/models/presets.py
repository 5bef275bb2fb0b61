"""Named architectures for planning without a checkpoint (``models.<name>.arch: llama-7b``).

The LLaMA shapes are those of the published LLaMA-2 (7B, 13B, 70B) and Code Llama (34B) configs;
the tiny ones are for tests and CPU runs; the mixtures of experts (Mixtral-8x7B, Qwen3-30B-A3B)
are their published configs, cited beside each. A critic or reward model is the same backbone with a
scalar head (``critic=True``).
"""

from __future__ import annotations

from restage.errors import ConfigError
from restage.models.config import ModelConfig


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int = 32000,
           positions: int = 4096, rope_theta: float = 10000.0) -> ModelConfig:
    return ModelConfig(family="llama", model_type="llama", vocab_size=vocab, hidden_size=hidden,
                       intermediate_size=inter, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                       max_positions=positions, norm_eps=1e-5, rope_theta=rope_theta, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)


def _mixtral_8x7b() -> ModelConfig:
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json: hidden_size 4096, intermediate_size
    # 14336 (each expert), 32 layers, 32 heads, 8 KV heads, num_local_experts 8, num_experts_per_tok 2, vocab 32000,
    # max_position_embeddings 32768, rope_theta 1e6, rms_norm_eps 1e-5, router_aux_loss_coef 0.02.
    return ModelConfig(family="llama", model_type="mixtral", vocab_size=32000, hidden_size=4096,
                       intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, max_positions=32768,
                       norm_eps=1e-5, rope_theta=1e6, bos_token_id=1, eos_token_id=2, num_experts=8,
                       experts_per_token=2, moe_intermediate_size=14336, norm_topk_prob=True,
                       router_aux_loss_coef=0.02, sparse_layers=tuple(range(32)))


def _qwen3_30b_a3b() -> ModelConfig:
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: hidden_size 2048, intermediate_size 6144,
    # 48 layers, 32 heads, 4 KV heads, head_dim 128, num_experts 128, num_experts_per_tok 8, moe_intermediate_size
    # 768, norm_topk_prob true, decoder_sparse_step 1, mlp_only_layers [], vocab 151936, max_position_embeddings
    # 40960, rope_theta 1e6, rms_norm_eps 1e-6, router_aux_loss_coef 0.001.
    return ModelConfig(family="llama", model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, max_positions=40960,
                       norm_eps=1e-6, rope_theta=1e6, bos_token_id=151643, eos_token_id=151645, head_dim=128,
                       qk_norm=True, num_experts=128, experts_per_token=8, moe_intermediate_size=768,
                       norm_topk_prob=True, router_aux_loss_coef=0.001, sparse_layers=tuple(range(48)))


PRESETS: dict[str, ModelConfig] = {
    "llama-7b": _llama(4096, 11008, 32, 32, 32),
    "llama-13b": _llama(5120, 13824, 40, 40, 40),
    "llama-34b": _llama(8192, 22016, 48, 64, 8, positions=16384, rope_theta=1e6),
    "llama-70b": _llama(8192, 28672, 80, 64, 8),
    # Small shapes for tests and CPU runs (vocabularies fit the test tokenizers' id range).
    "llama-tiny": _llama(64, 172, 2, 4, 2, vocab=512, positions=512),
    "llama-small": _llama(256, 688, 4, 8, 4, vocab=2048, positions=1024),
    "llama-1b": _llama(2048, 5504, 22, 32, 4, positions=2048),
    # Mixtures of experts.
    "mixtral-8x7b": _mixtral_8x7b(),
    "qwen3-30b-a3b": _qwen3_30b_a3b(),
}


def preset(name: str, critic: bool = False) -> ModelConfig:
    """The architecture called ``name``; with ``critic`` its scalar-head variant."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ConfigError(f"architecture preset {name!r} is unknown; use one of {', '.join(PRESETS)}") from None
    return cfg.as_critic() if critic else cfg
