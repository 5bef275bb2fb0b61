"""Named architectures for planning without a checkpoint (``models.<name>.arch: llama-7b``).

The LLaMA shapes are those of the published LLaMA-2 (7B, 13B, 70B) and Code Llama (34B) configs;
the tiny ones are for tests and CPU runs. A critic or reward model is the same backbone with a
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


PRESETS: dict[str, ModelConfig] = {
    "llama-7b": _llama(4096, 11008, 32, 32, 32),
    "llama-13b": _llama(5120, 13824, 40, 40, 40),
    "llama-34b": _llama(8192, 22016, 48, 64, 8, positions=16384, rope_theta=1e6),
    "llama-70b": _llama(8192, 28672, 80, 64, 8),
    # Small shapes for tests and CPU runs (vocabularies fit the test tokenizers' id range).
    "llama-tiny": _llama(64, 172, 2, 4, 2, vocab=512, positions=512),
    "llama-small": _llama(256, 688, 4, 8, 4, vocab=2048, positions=1024),
    "llama-1b": _llama(2048, 5504, 22, 32, 4, positions=2048),
}


def preset(name: str, critic: bool = False) -> ModelConfig:
    """The architecture called ``name``; with ``critic`` its scalar-head variant."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ConfigError(f"architecture preset {name!r} is unknown; use one of {', '.join(PRESETS)}") from None
    return cfg.as_critic() if critic else cfg
