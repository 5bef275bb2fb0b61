"""The mixture-of-experts fields of a HF ``config.json`` (Mixtral, Qwen3-MoE), read and written.

Kept beside ``arch.py`` so that file stays about the dense shapes; ``ModelConfig`` holds what
this returns. Which layers are sparse is resolved here once (Qwen3-MoE's ``decoder_sparse_step``
and ``mlp_only_layers``), so the decoder, sharding and the estimator ask ``cfg.is_sparse(i)``.
"""

from __future__ import annotations

from typing import Any, assert_never

from restage.errors import CheckpointError
from restage.models.family import MoeFamily

# Architectures with a mixture we do not build yet, and what to use instead (one line each).
REFUSED_ARCHITECTURES = {
    "Qwen2MoeForCausalLM": "Qwen2-MoE's shared experts are not supported yet; use a Mixtral or Qwen3-MoE checkpoint",
    "Qwen2MoeForSequenceClassification": "Qwen2-MoE's shared experts are not supported yet; use a Mixtral or "
                                         "Qwen3-MoE checkpoint",
}


def moe_fields(hf: dict[str, Any], moe: MoeFamily | None, source: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments for the mixture (none for a dense model); one-line errors."""
    if moe is None:
        return {}
    layers = hf["num_hidden_layers"]
    # transformers 5 writes num_local_experts for both; published Qwen3-MoE configs say num_experts.
    experts = hf.get("num_local_experts", hf.get("num_experts"))
    if experts is None:
        raise CheckpointError(f"{source}: config.json lacks num_local_experts (or num_experts); is it a MoE config?")
    top_k = hf.get("num_experts_per_tok", 2)
    if not 1 <= top_k <= experts:
        raise CheckpointError(f"{source}: num_experts_per_tok={top_k} must be between 1 and num_experts={experts}; "
                              "fix config.json")
    if hf.get("router_jitter_noise"):
        raise CheckpointError(f"{source}: router_jitter_noise={hf['router_jitter_noise']} is not supported; set it "
                              "to 0 in config.json")
    match moe.kind:
        case "mixtral":
            return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=hf["intermediate_size"],
                        norm_topk_prob=True, router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.02)),
                        sparse_layers=tuple(range(layers)))
        case "qwen3_moe":
            return _qwen3_moe_fields(hf, layers, experts, top_k, source)
        case unknown:
            assert_never(unknown)


def _qwen3_moe_fields(hf: dict[str, Any], layers: int, experts: int, top_k: int, source: str) -> dict[str, Any]:
    """Qwen3-MoE's mixture: which layers are sparse (``decoder_sparse_step``, ``mlp_only_layers``), expert widths."""
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise CheckpointError(f"{source}: decoder_sparse_step={step!r} must be a positive integer; fix config.json")
    dense = set(hf.get("mlp_only_layers") or ())
    if bad := sorted(i for i in dense if not (isinstance(i, int) and 0 <= i < layers)):
        raise CheckpointError(f"{source}: mlp_only_layers names layers {bad} outside 0..{layers - 1}; fix config.json")
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    return dict(num_experts=experts, experts_per_token=top_k, moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)), sparse_layers=sparse)


def moe_hf_dict(moe: MoeFamily | None, num_layers: int, num_experts: int, experts_per_token: int, moe_intermediate_size: int,
                norm_topk_prob: bool, router_aux_loss_coef: float, sparse_layers: tuple[int, ...]) -> dict[str, Any]:
    """The ``config.json`` keys that describe the mixture (inverse of ``moe_fields``)."""
    if moe is None:
        return {}
    out: dict[str, Any] = dict(num_local_experts=num_experts, num_experts_per_tok=experts_per_token,
                               router_aux_loss_coef=router_aux_loss_coef, output_router_logits=False,
                               router_jitter_noise=0.0)
    match moe.kind:
        case "mixtral":
            pass
        case "qwen3_moe":
            out.update(num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
                       norm_topk_prob=norm_topk_prob, decoder_sparse_step=1,
                       mlp_only_layers=[i for i in range(num_layers) if i not in sparse_layers])
            del out["router_jitter_noise"]
        case unknown:
            assert_never(unknown)
    return out
