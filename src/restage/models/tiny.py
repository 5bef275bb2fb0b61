"""Small random HF models of every supported family, built locally (no download) for tests, demos and benchmarks.

The weights come from transformers' own ``from_config`` initialisation, then norms and biases are
perturbed so that a loader that mixes them up cannot pass a comparison by luck.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Literal, assert_never, get_args

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from restage.models import family as families

FAMILIES = tuple(families.FAMILIES)  # the model_types build_tiny writes
WeightFormat = Literal["safetensors", "bin"]  # model.safetensors (sharded past max_shard_size) or pytorch_model.bin

# Deliberately awkward sizes: the vocabulary and MLP width do not divide by 2, so TP splits are uneven.
TINY_SIZES = dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=171,
                  vocab_size=257, max_positions=256)
# About 40M parameters: a model big enough for a meaningful CPU generation benchmark.
BENCH_SIZES = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1408,
                   vocab_size=16384, max_positions=1024)


def quiet_transformers() -> ModuleType:
    """The ``transformers`` module, imported here only (heavy and optional: training never needs it), logs quiet."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # transformers leaves these two unannotated
    logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    return transformers


def tiny_hf_config(family: str = "llama", tied: bool = False, critic: bool = False, sliding_window: int | None = None,
                   head_dim: int | None = None, rope_parameters: dict[str, Any] | None = None,
                   **sizes: Any) -> Any:
    """A transformers config of ``family`` with the given sizes (defaults: TINY_SIZES).

    ``head_dim``: an explicit head width (default hidden_size / heads); ``rope_parameters``: a RoPE
    scaling dict (``rope_type`` and its keys) for the llama family.
    """
    transformers = quiet_transformers()

    s = {**TINY_SIZES, **sizes}
    common = dict(vocab_size=s["vocab_size"], bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=tied,
                  initializer_range=0.1)
    if critic:
        common["num_labels"] = 1
    if family not in families.FAMILIES:
        raise ValueError(f"unknown family {family!r}; use one of {FAMILIES}")
    traits = families.FAMILIES[family]
    match traits.backbone:
        case "gpt2":
            config = transformers.GPT2Config(n_embd=s["hidden_size"], n_layer=s["num_layers"], n_head=s["num_heads"],
                                             n_inner=s["intermediate_size"], n_positions=s["max_positions"], **common)
            config.architectures = [traits.hf_architecture(critic)]
            return config
        case "llama":
            pass
        case unknown:
            assert_never(unknown)
    extra: dict[str, Any] = {}
    match traits.window:
        case "sliding_window":  # Mistral, Mixtral: the width given (None: no window)
            extra["sliding_window"] = sliding_window
        case "use_sliding_window" | None:
            pass
        case unknown_window:
            assert_never(unknown_window)
    theta = _ROPE_THETAS.get(family, 10000.0)
    extra["rope_parameters"] = {"rope_type": "default", **(rope_parameters or {}), "rope_theta": theta}
    if head_dim is not None or traits.default_head_dim is not None:  # Qwen3Config's is 128, not hidden / heads
        extra["head_dim"] = head_dim or s["hidden_size"] // s["num_heads"]
    if traits.moe is not None:
        extra.update(_moe_options(traits.moe.kind, s))
    config = getattr(transformers, traits.hf_name + "Config")(
        hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"], num_attention_heads=s["num_heads"],
        num_key_value_heads=s["num_kv_heads"], intermediate_size=s["intermediate_size"],
        max_position_embeddings=s["max_positions"], **extra, **common)
    config.architectures = [traits.hf_architecture(critic)]
    return config


# Each family's tiny models get a RoPE theta of their own, so a loader that ignores it fails a comparison.
_ROPE_THETAS = {"qwen2": 5000.0, "qwen3": 20000.0, "qwen3_moe": 20000.0}


def _moe_options(kind: families.MoeKind, sizes: dict[str, Any]) -> dict[str, Any]:
    """The mixture's config keys of a tiny MoE model: 4 experts, top 2, a large aux-loss coefficient so that a test
    sees the loss's gradient; Qwen3-MoE: experts 43 wide (odd), top-k not renormalised, layer 1 dense. ``sizes``
    may override each (num_experts, experts_per_token, router_aux_loss_coef, moe_intermediate_size, norm_topk_prob,
    mlp_only_layers)."""
    out = dict(num_local_experts=sizes.get("num_experts", 4), num_experts_per_tok=sizes.get("experts_per_token", 2),
               router_aux_loss_coef=sizes.get("router_aux_loss_coef", 0.1))
    match kind:
        case "mixtral":
            pass
        case "qwen3_moe":
            out.update(moe_intermediate_size=sizes.get("moe_intermediate_size", 43),
                       norm_topk_prob=sizes.get("norm_topk_prob", False),
                       mlp_only_layers=sizes.get("mlp_only_layers", [1]))
        case unknown:
            assert_never(unknown)
    return out


_WORDS = ("the a an and or but if then so of to in on at by for with from up down out over under again is are was "
          "were be been have has had do does did can will would should could may might must i you he she it we they me "
          "him her us them my your his its our their this that these those what which who when where why how all any "
          "both each few more most other some such no nor not only own same than too very one two three four five six "
          "seven eight nine ten cat dog sat ran saw big small red blue green good bad new old yes hello world").split()


def build_tiny_tokenizer(path: str | Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` ids (0 pad, 1 bos, 2 eos, 3 unk, then common words, then w<i>)."""
    transformers = quiet_transformers()

    words = ["<pad>", "<s>", "</s>", "<unk>", *_WORDS]
    words += [f"w{i}" for i in range(len(words), vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words[:vocab_size])}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))


def build_tiny(path: str | Path, family: str = "llama", tied: bool = False, critic: bool = False, seed: int = 0,
               sliding_window: int | None = None, head_dim: int | None = None,
               rope_parameters: dict[str, Any] | None = None, weight_format: WeightFormat = "safetensors",
               max_shard_size: str | int | None = None, dtype: torch.dtype = torch.float32, tokenizer: bool = True,
               **sizes: Any) -> Path:
    """Write a random HF model directory (with a word-level tokenizer unless ``tokenizer=False``).

    ``weight_format`` is ``safetensors`` or ``bin`` (``pytorch_model.bin``).
    """
    transformers = quiet_transformers()
    config = tiny_hf_config(family, tied=tied, critic=critic, sliding_window=sliding_window, head_dim=head_dim,
                            rope_parameters=rope_parameters, **sizes)
    torch.manual_seed(seed)
    cls = transformers.AutoModelForSequenceClassification if critic else transformers.AutoModelForCausalLM
    model = cls.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif param.dim() == 1:  # norm scales
                param.normal_(1.0, 0.1)
    model = model.to(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(path, **kwargs)
    match weight_format:
        case "bin":
            for file in path.glob("model*.safetensors*"):
                file.unlink()
            torch.save(model.state_dict(), path / "pytorch_model.bin")
        case "safetensors":
            pass
        case _:  # a caller's typo, not caught by a type checker in a test
            raise ValueError(f"weight_format must be one of {get_args(WeightFormat)}, not {weight_format!r}")
    if tokenizer:
        build_tiny_tokenizer(path, config.vocab_size)
    return path


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> Any:
    """The transformers model stored at ``path`` (eval mode, eager-free SDPA attention)."""
    transformers = quiet_transformers()
    config = transformers.AutoConfig.from_pretrained(path)
    critic = (config.architectures or [""])[0].endswith(families.CRITIC_SUFFIX)
    cls = transformers.AutoModelForSequenceClassification if critic else transformers.AutoModelForCausalLM
    # The eager experts loop: transformers' default grouped matmul needs 16-byte aligned widths (ours are odd).
    extra = {"experts_implementation": "eager"} if getattr(config, "num_local_experts", None) else {}
    return cls.from_pretrained(path, dtype=dtype, **extra).eval()
