"""HF tensor names and layouts <-> canonical parameters (see ``sharding.py``).

LLaMA/Mistral/Qwen2/Qwen3 store ``nn.Linear`` weights ``[out, in]`` like we do, under other names.
GPT-2 stores ``Conv1D`` weights transposed (``[in, out]``) and fuses q, k, v into one
``c_attn`` tensor; a canonical parameter therefore maps to a (key, offset, transpose) source,
from which any slice of it can be read without reading the rest of the HF tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, assert_never

import torch

from restage.device import TORCH_NAMES
from restage.models.arch import ModelConfig
from restage.models.family import Activation
from restage.models.moe_arch import moe_hf_dict
from restage.models.rope import rope_to_hf
from restage.models.sharding import ParamSpec

_FUSED_ORDER = ("attn.q", "attn.k", "attn.v")  # their slices of a fused q/k/v tensor, in this order
# Prefixes older or headless checkpoints leave out (e.g. the original gpt2 weights: "h.0.ln_1.weight").
BASE_PREFIXES = ("model.", "transformer.")


@dataclass(frozen=True)
class HFSource:
    """Where a canonical parameter lives in a HF checkpoint."""

    key: str
    transpose: bool = False  # HF stores it [in, out] (GPT-2 Conv1D)
    offset: int = 0  # start along canonical dim 0 inside a fused HF tensor (q/k/v in c_attn)
    fused: bool = False  # a slice of a fused q/k/v tensor (GPT-2's c_attn)

    def hf_index(self, spec: ParamSpec, index: tuple[slice, ...]) -> tuple[slice, ...]:
        """The HF-tensor index that holds ``full_param[index]``."""
        explicit = [slice(s.start or 0, spec.shape[d] if s.stop is None else s.stop) for d, s in enumerate(index)]
        explicit[0] = slice(explicit[0].start + self.offset, explicit[0].stop + self.offset)
        return tuple(reversed(explicit)) if self.transpose else tuple(explicit)

    def to_canonical(self, hf_slice: torch.Tensor) -> torch.Tensor:
        return hf_slice.t() if self.transpose else hf_slice


def hf_source(cfg: ModelConfig, name: str) -> HFSource:
    """The HF tensor a canonical parameter name maps to."""
    names = cfg.traits.hf
    if name in names.top:
        return HFSource(names.top[name])
    _, layer, rest = name.split(".", 2)  # layers.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    prefix = names.layer_prefix.format(layer=layer)
    weight = kind == "weight"
    if module.startswith("mlp.experts.") or module == "mlp.router":
        moe = cfg.traits.moe
        assert moe is not None, f"{name} in a dense {cfg.model_type} model"
        if module == "mlp.router":
            return HFSource(f"{prefix}{moe.router}.{kind}")
        _, _, expert, proj = module.split(".")  # mlp.experts.<e>.<gate|up|down>
        return HFSource(f"{prefix}{moe.experts[proj].format(e=expert)}.{kind}")
    if names.fused_qkv is not None and module in _FUSED_ORDER:
        offset = (0, cfg.num_heads, cfg.num_heads + cfg.num_kv_heads)[_FUSED_ORDER.index(module)] * cfg.head_dim
        return HFSource(f"{prefix}{names.fused_qkv}.{kind}", transpose=weight, offset=offset, fused=True)
    return HFSource(f"{prefix}{names.layer[module]}.{kind}", transpose=weight and module in names.transposed)


def to_hf_tensors(cfg: ModelConfig, canonical: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full canonical tensors -> HF tensors (GPT-2: transposed, q/k/v fused). Needs all parts of a fused tensor."""
    parts: dict[str, list[tuple[int, HFSource, torch.Tensor]]] = {}
    for name, tensor in canonical.items():
        source = hf_source(cfg, name)
        parts.setdefault(source.key, []).append((source.offset, source, tensor))
    out = {}
    for key, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        joined = torch.cat([t for _, _, t in pieces], dim=0) if len(pieces) > 1 else pieces[0][2]
        out[key] = (joined.t() if pieces[0][1].transpose else joined).contiguous()
    return out


_GPT2_ACTIVATION_NAMES: dict[Activation, str] = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu",
                                                 "silu": "silu"}


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` for ``cfg`` that transformers loads; keeps every key of ``base`` it does not own."""
    out = dict(base or {})
    out.update(architectures=[cfg.hf_architecture], model_type=cfg.model_type, vocab_size=cfg.vocab_size,
               bos_token_id=cfg.bos_token_id, pad_token_id=cfg.pad_token_id,
               # a list of EOS ids in the source's config.json stays as it was (generation_config.json is copied)
               eos_token_id=out["eos_token_id"] if isinstance(out.get("eos_token_id"), list) else cfg.eos_token_id,
               dtype=TORCH_NAMES[dtype], tie_word_embeddings=cfg.tied_embeddings)
    if cfg.is_critic:
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    else:
        for key in ("num_labels", "id2label", "label2id", "problem_type"):
            out.pop(key, None)
    family = cfg.traits
    match family.backbone:
        case "gpt2":
            out.update(n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_heads,
                       n_positions=cfg.max_positions, n_inner=cfg.intermediate_size, layer_norm_epsilon=cfg.norm_eps,
                       activation_function=_GPT2_ACTIVATION_NAMES[cfg.act])
            return out
        case "llama":
            pass
        case unknown:
            assert_never(unknown)
    out.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
               num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
               max_position_embeddings=cfg.max_positions, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
               rope_theta=cfg.rope_theta, rope_parameters=rope_to_hf(cfg.rope_theta, cfg.rope_scaling))
    # transformers reads rope_scaling before rope_parameters: drop the source's, which the line above replaces
    for key in ("rope_scaling", "original_max_position_embeddings"):
        out.pop(key, None)
    out.update(moe_hf_dict(family.moe, cfg.num_layers, cfg.num_experts, cfg.experts_per_token,
                           cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.router_aux_loss_coef, cfg.sparse_layers))
    if family.writes_attention_bias:  # covers q, k, v and o alike
        out["attention_bias"] = cfg.o_bias
    match family.window:
        case "sliding_window":
            out["sliding_window"] = cfg.sliding_window
        case "use_sliding_window":
            out["use_sliding_window"] = False
        case None:
            pass
        case unknown_window:
            assert_never(unknown_window)
    return out
