"""Architecture description of a decoder, read from a HF ``config.json``.

One dataclass covers every supported family: the LLaMA family (LLaMA, Mistral, Qwen2, Qwen3, and
the mixture-of-experts Mixtral and Qwen3-MoE) and GPT-2. Everything downstream (the decoder,
sharding, the estimator) reads only this, and the fixed traits of its family (``family.py``, ``cfg.traits``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, assert_never

from restage.errors import CheckpointError, hub_hint
from restage.models.family import ARCHITECTURES, FAMILIES, Activation, Backbone, Family
from restage.models.moe_arch import REFUSED_ARCHITECTURES, moe_fields
from restage.models.rope import RopeScaling, rope_from_hf

# GPT-2 activation_function -> our activation name.
_GPT2_ACTIVATIONS: dict[str, Activation] = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu", "silu": "silu",
    "swish": "silu"}
# Named in the error for a model_type that does not match its architecture.
_DENSE_MODEL_TYPES = [f.model_type for f in FAMILIES.values() if f.moe is None]
_MOE_MODEL_TYPES = [f.model_type for f in FAMILIES.values() if f.moe is not None]


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on some linears (``models/lora.py``): ``y = W x + (alpha / rank) B A x``, W frozen.

    ``target_modules`` are canonical module names (q, k, v, o, gate, up, down), checked by ``config.LoraSpec``.
    """

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))  # JSON gives a list

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and options of one decoder; ``family`` is its backbone, ``llama`` or ``gpt2``."""

    family: Backbone
    model_type: str  # HF model_type, a key of family.FAMILIES: llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, gpt2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_positions: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tied_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2, GPT-2, LLaMA with attention_bias
    o_bias: bool = False  # GPT-2, LLaMA with attention_bias (not Qwen2)
    is_critic: bool = False  # scalar head (critic, reward) instead of the LM head
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Every id that ends an answer: config.json's eos_token_id (an id or a list) and generation_config.json's
    # (Llama-3-Instruct ends turns with <|eot_id|>, not the first id). Empty: eos_token_id alone.
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    sliding_window: int | None = None  # Mistral: attend to the last `sliding_window` tokens only
    activation: Activation | Literal[""] = ""  # "": the family's default (``act``)
    head_dim: int = 0  # width of one attention head; 0: hidden_size // num_heads (Qwen3 sets its own)
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head (weights [head_dim]) before RoPE
    rope_scaling: RopeScaling | None = None  # None: the default RoPE (see models/rope.py)
    lora: LoraConfig | None = None  # adapters on a frozen base (models/lora.py); None: dense
    # Mixture of experts (models/moe.py); num_experts == 0 is a dense model.
    num_experts: int = 0
    experts_per_token: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1 (Mixtral always does)
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added in training
    sparse_layers: tuple[int, ...] = ()  # the layers whose MLP is the mixture (the others are dense)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))  # JSON gives a list
        object.__setattr__(self, "sparse_layers", tuple(self.sparse_layers))
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        object.__setattr__(self, "rope_scaling", RopeScaling.from_json(self.rope_scaling))  # JSON gives a dict
        if isinstance(self.lora, dict):  # from JSON, or from asdict (as_critic)
            object.__setattr__(self, "lora", LoraConfig(**self.lora))
        if self.model_type not in FAMILIES or FAMILIES[self.model_type].backbone != self.family:
            raise ValueError(f"model_type {self.model_type!r} with family {self.family!r}: not one of "
                             f"{[(f.model_type, f.backbone) for f in FAMILIES.values()]}")

    @property
    def traits(self) -> Family:
        """The fixed architecture of this model's family (norms, positions, MLP, HF names)."""
        return FAMILIES[self.model_type]

    @property
    def act(self) -> Activation:
        """The MLP's activation."""
        return self.activation or self.traits.default_activation

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and bool(self.sparse_layers)

    def is_sparse(self, layer: int) -> bool:
        """Whether block ``layer``'s MLP is the mixture of experts."""
        return layer in self.sparse_layers

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The token ids that end generation."""
        return self.eos_token_ids or (() if self.eos_token_id is None else (self.eos_token_id,))

    @property
    def hf_architecture(self) -> str:
        return self.traits.hf_architecture(self.is_critic)

    def as_critic(self) -> ModelConfig:
        """The same backbone with a scalar head."""
        return ModelConfig(**{**asdict(self), "is_critic": True, "tied_embeddings": False})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**data)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config") -> ModelConfig:
        """Read a HF config dict; raise CheckpointError naming the supported architectures."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in REFUSED_ARCHITECTURES:
            raise CheckpointError(f"{source}: {REFUSED_ARCHITECTURES[arch]}")
        if arch not in ARCHITECTURES:
            supported = ", ".join(sorted(ARCHITECTURES))
            raise CheckpointError(f"{source}: architecture {arch!r} is not supported; use one of: {supported}")
        family, is_critic = ARCHITECTURES[arch]
        if is_critic and hf.get("num_labels", len(hf.get("id2label", {}) or {0: 0})) not in (1, None):
            raise CheckpointError(f"{source}: a critic/reward model needs num_labels=1")
        try:
            match family.backbone:
                case "gpt2":
                    return cls(**_gpt2_fields(hf, is_critic, source))
                case "llama":
                    return cls(**_llama_fields(hf, family, arch, is_critic, source))
                case unknown:
                    assert_never(unknown)
        except KeyError as missing:
            raise CheckpointError(f"{source}: config.json lacks {missing}; is it a HF model config?") from None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``."""
        path = Path(path)
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist; point the model's path at a HF model directory"
                                  f"{hub_hint(path)}")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise CheckpointError(f"{path} has no config.json; point the model's path at a HF model directory"
                                  f"{hub_hint(path)}")
        try:
            hf = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{config_file} is not valid JSON ({err.msg} at line {err.lineno}); fix or replace it") from None
        cfg = cls.from_hf_dict(hf, source=str(path))
        generation = path / "generation_config.json"
        if generation.is_file():
            try:
                extra = _ids(json.loads(generation.read_text()).get("eos_token_id"))
            except json.JSONDecodeError as err:
                raise CheckpointError(f"{generation} is not valid JSON ({err.msg} at line {err.lineno}); fix or "
                                      "remove it") from None
            ids = tuple(dict.fromkeys((*cfg.stop_token_ids, *extra)))
            cfg = replace(cfg, eos_token_ids=ids) if ids != cfg.stop_token_ids else cfg
        return cfg


def _gpt2_fields(hf: dict[str, Any], is_critic: bool, source: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a GPT-2 ``config.json``."""
    hidden = hf["n_embd"]
    activation = _GPT2_ACTIVATIONS.get(hf.get("activation_function", "gelu_new"))
    if activation is None:
        raise CheckpointError(f"{source}: activation_function {hf.get('activation_function')!r} is not "
                              f"supported; use one of {sorted(_GPT2_ACTIVATIONS)}")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights", True) is False:
        raise CheckpointError(f"{source}: only GPT-2's default attention scaling is supported")
    return dict(
        family="gpt2", model_type="gpt2", vocab_size=hf["vocab_size"], hidden_size=hidden,
        intermediate_size=hf.get("n_inner") or 4 * hidden, num_layers=hf["n_layer"],
        num_heads=hf["n_head"], num_kv_heads=hf["n_head"], max_positions=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        tied_embeddings=bool(hf.get("tie_word_embeddings", True)) and not is_critic,
        qkv_bias=True, o_bias=True, is_critic=is_critic, bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_first(hf.get("eos_token_id")), eos_token_ids=_ids(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"), activation=activation,
    )


def _llama_fields(hf: dict[str, Any], family: Family, arch: str, is_critic: bool, source: str) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of a LLaMA-family ``config.json`` (``family`` from its architecture)."""
    model_type = hf.get("model_type", family.model_type)
    if model_type != family.model_type:
        raise CheckpointError(f"{source}: model_type {model_type!r} does not match architecture {arch!r}; set "
                              f"model_type to {family.model_type!r} (supported: {', '.join(_DENSE_MODEL_TYPES)}) "
                              f"(mixtures of experts: {', '.join(_MOE_MODEL_TYPES)})")
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or family.default_head_dim or hf["hidden_size"] // num_heads
    if hf.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported; only silu")
    rope_theta, rope_scaling = rope_from_hf(hf, source)
    sliding_window = None
    match family.window:
        case "sliding_window":
            sliding_window = hf.get("sliding_window")
        case "use_sliding_window":
            if hf.get("use_sliding_window"):
                raise CheckpointError(f"{source}: {family.hf_name} use_sliding_window=true is not supported; "
                                      "set it to false")
        case None:
            pass
        case unknown:
            assert_never(unknown)
    return dict(
        family=family.backbone, model_type=model_type, vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        max_positions=hf.get("max_position_embeddings", 2048), norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)) and not is_critic,
        qkv_bias=family.qkv_bias or bool(hf.get("attention_bias", False)), head_dim=head_dim,
        qk_norm=family.qk_norm, o_bias=bool(hf.get("attention_bias", False)), is_critic=is_critic,
        bos_token_id=hf.get("bos_token_id"), eos_token_id=_first(hf.get("eos_token_id")),
        eos_token_ids=_ids(hf.get("eos_token_id")), pad_token_id=hf.get("pad_token_id"),
        sliding_window=sliding_window, activation="silu", **moe_fields(hf, family.moe, source),
    )


def _first(value: object) -> object:
    return value[0] if isinstance(value, list) and value else value


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    """An eos_token_id entry (None, an id, or a list of ids) as a tuple."""
    return () if value is None else tuple(int(v) for v in (value if isinstance(value, list) else [value]))
