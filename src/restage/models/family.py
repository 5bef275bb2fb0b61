"""One description per model family: what its decoder builds and how its HF checkpoints name things.

A ``Family`` per HF ``model_type`` (LLaMA, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, GPT-2), found by
``ModelConfig.traits``. The decoder, sharding, the HF adapter and the estimator read its fields instead of
asking "is this GPT-2?"; a new family is one more entry here. Per-checkpoint options (``attention_bias``,
tied embeddings, the sliding window's width) stay on ``ModelConfig``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

Backbone = Literal["llama", "gpt2"]  # ModelConfig.family: the block layout a family shares
NormKind = Literal["rmsnorm", "layernorm"]  # layernorm has a bias
PositionKind = Literal["rope", "learned"]  # learned: a position embedding table (pos_embed)
Activation = Literal["silu", "gelu_tanh", "gelu", "relu"]
# How config.json speaks of a sliding window: Mistral's width (``sliding_window``), or Qwen's off switch
# (``use_sliding_window``, which we refuse when true); None: the family has none.
WindowKey = Literal["sliding_window", "use_sliding_window"]
MoeKind = Literal["mixtral", "qwen3_moe"]

CRITIC_SUFFIX = "ForSequenceClassification"  # critic and reward models: XForSequenceClassification, num_labels=1


@dataclass(frozen=True)
class HFNames:
    """Where a family's checkpoints keep each canonical parameter (read by ``hf_adapter.hf_source``)."""

    top: Mapping[str, str]  # whole-model parameters: canonical name -> HF key
    layer_prefix: str  # HF prefix of block ``{layer}``'s tensors
    layer: Mapping[str, str]  # canonical module of a block -> HF module
    # GPT-2 fuses q, k, v (in this order) into one tensor under this module; None: three tensors.
    fused_qkv: str | None = None
    # Modules whose weight HF stores ``[in, out]`` (GPT-2's Conv1D; the fused q/k/v too).
    transposed: frozenset[str] = frozenset()

    @property
    def canonical_layout(self) -> bool:
        """Whether every HF weight is one canonical tensor as we hold it (no fusing, no transposing)."""
        return self.fused_qkv is None and not self.transposed


@dataclass(frozen=True)
class MoeFamily:
    """How a mixture-of-experts family routes and names its experts (``moe.py``, ``moe_arch.py``)."""

    kind: MoeKind
    router: str  # HF module of the router, under the layer prefix
    experts: Mapping[str, str]  # gate/up/down -> HF module of expert ``{e}``
    # Qwen3-MoE casts the routing weights to the model dtype before weighting; Mixtral weights in fp32.
    routing_weights_in_model_dtype: bool


@dataclass(frozen=True)
class Family:
    """The fixed architecture of one HF ``model_type``."""

    model_type: str  # HF model_type
    hf_name: str  # prefix of its HF class names ("Qwen3" in Qwen3ForCausalLM)
    backbone: Backbone
    causal_lm_suffix: str  # HF class suffix of the language model ("ForCausalLM", GPT-2's "LMHeadModel")
    norm: NormKind
    positions: PositionKind
    gated_mlp: bool  # SwiGLU (gate, up, down); else up and down
    mlp_bias: bool  # biases on the MLP's linears
    default_activation: Activation  # when config.json does not choose one
    hf: HFNames
    default_head_dim: int | None = None  # when config.json leaves head_dim out; None: hidden_size / heads
    qkv_bias: bool = False  # q, k, v have biases whatever attention_bias says (Qwen2)
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    writes_attention_bias: bool = False  # its config.json carries attention_bias (q, k, v and o alike)
    window: WindowKey | None = None
    moe: MoeFamily | None = None

    @property
    def norm_bias(self) -> bool:
        match self.norm:
            case "layernorm":
                return True
            case "rmsnorm":
                return False

    def hf_architecture(self, is_critic: bool) -> str:
        """The HF class name of this family's language model, or of its critic."""
        return self.hf_name + (CRITIC_SUFFIX if is_critic else self.causal_lm_suffix)


_LLAMA_NAMES = HFNames(
    top={"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight",
         "lm_head.weight": "lm_head.weight", "score.weight": "score.weight"},
    layer_prefix="model.layers.{layer}.",
    layer={"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn.q": "self_attn.q_proj",
           "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
           "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
           "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"},
)
_GPT2_NAMES = HFNames(
    top={"embed.weight": "transformer.wte.weight", "pos_embed.weight": "transformer.wpe.weight",
         "final_norm.weight": "transformer.ln_f.weight", "final_norm.bias": "transformer.ln_f.bias",
         "lm_head.weight": "lm_head.weight", "score.weight": "score.weight"},
    layer_prefix="transformer.h.{layer}.",
    layer={"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.o": "attn.c_proj", "mlp.up": "mlp.c_fc",
           "mlp.down": "mlp.c_proj"},
    fused_qkv="attn.c_attn",
    transposed=frozenset({"attn.o", "mlp.up", "mlp.down"}),
)
# The experts as transformers 5 saves them (one tensor per expert, not its in-memory fused [E, 2I, H] form).
# Mixtral: w1 = gate, w3 = up, w2 = down.
_MIXTRAL_MOE = MoeFamily(kind="mixtral", router="block_sparse_moe.gate",
                         experts={"gate": "block_sparse_moe.experts.{e}.w1", "up": "block_sparse_moe.experts.{e}.w3",
                                  "down": "block_sparse_moe.experts.{e}.w2"},
                         routing_weights_in_model_dtype=False)
_QWEN3_MOE = MoeFamily(kind="qwen3_moe", router="mlp.gate",
                       experts={"gate": "mlp.experts.{e}.gate_proj", "up": "mlp.experts.{e}.up_proj",
                                "down": "mlp.experts.{e}.down_proj"},
                       routing_weights_in_model_dtype=True)

LLAMA = Family(model_type="llama", hf_name="Llama", backbone="llama", causal_lm_suffix="ForCausalLM", norm="rmsnorm",
               positions="rope", gated_mlp=True, mlp_bias=False, default_activation="silu", hf=_LLAMA_NAMES,
               writes_attention_bias=True)
MISTRAL = replace(LLAMA, model_type="mistral", hf_name="Mistral", writes_attention_bias=False, window="sliding_window")
QWEN2 = replace(LLAMA, model_type="qwen2", hf_name="Qwen2", qkv_bias=True, writes_attention_bias=False,
                window="use_sliding_window")
# transformers' Qwen3Config defaults head_dim to 128 (not hidden_size / heads) when config.json leaves it out.
QWEN3 = replace(LLAMA, model_type="qwen3", hf_name="Qwen3", default_head_dim=128, qk_norm=True,
                window="use_sliding_window")
MIXTRAL = replace(MISTRAL, model_type="mixtral", hf_name="Mixtral", moe=_MIXTRAL_MOE)
QWEN3_MOE = replace(QWEN3, model_type="qwen3_moe", hf_name="Qwen3Moe", moe=_QWEN3_MOE)
GPT2 = Family(model_type="gpt2", hf_name="GPT2", backbone="gpt2", causal_lm_suffix="LMHeadModel", norm="layernorm",
              positions="learned", gated_mlp=False, mlp_bias=True, default_activation="gelu_tanh", hf=_GPT2_NAMES,
              qkv_bias=True)

FAMILIES: dict[str, Family] = {f.model_type: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, GPT2)}
# HF class name -> (family, is_critic). Critic and reward models load directly in transformers.
ARCHITECTURES: dict[str, tuple[Family, bool]] = {
    f.hf_architecture(critic): (f, critic) for critic in (False, True) for f in FAMILIES.values()}
