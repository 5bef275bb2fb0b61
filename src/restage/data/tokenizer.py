"""Tokenizer loading (any HF tokenizer directory) and the word-level tokenizer of the synthetic task."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from restage.errors import ConfigError, hub_hint


def build_word_tokenizer(vocab: Sequence[str], out_dir: str | Path) -> Path:
    """Save a whitespace word-level tokenizer over ``vocab`` (special tokens first) as a HF tokenizer directory.

    ``vocab`` must start with ``[PAD] [BOS] [EOS] [UNK]``; ids follow the order of ``vocab``. The
    directory holds ``tokenizer.json`` and ``tokenizer_config.json`` and loads with
    ``transformers.AutoTokenizer.from_pretrained``.
    """
    # lazy: transformers takes seconds to import; data loading needs it only to build or load a tokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if tuple(vocab[:4]) != ("[PAD]", "[BOS]", "[EOS]", "[UNK]"):
        raise ValueError(f"vocab must start with [PAD] [BOS] [EOS] [UNK], got {list(vocab[:4])}")
    core = Tokenizer(models.WordLevel({token: i for i, token in enumerate(vocab)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="[BOS]", eos_token="[EOS]", pad_token="[PAD]",
                                   unk_token="[UNK]")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return out_dir


# Classes that load tokenizer.json as it is. transformers 5's AutoTokenizer re-builds a checkpoint directory's
# tokenizer as its model type's class (a qwen2 directory's as Qwen2Tokenizer: byte-level BPE), which drops the
# words of any other tokenizer.json saved there; one saved under a generic class is loaded as that class.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def saved_class(path: Path) -> str:
    try:
        return str(json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class") or "")
    except (OSError, ValueError):
        return ""


def load_tokenizer(path: str | Path):
    """``AutoTokenizer.from_pretrained(path)`` (a tokenizer saved under a generic class: that class), with a
    one-line error when the directory is missing or not a tokenizer."""
    # lazy: transformers takes seconds to import; only here
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"tokenizer directory {path} does not exist; set dataset.tokenizer (or the model path) to a "
                          f"HF tokenizer directory{hub_hint(path)}")
    try:
        generic = saved_class(path) in GENERIC_CLASSES and (path / "tokenizer.json").is_file()
        tokenizer = (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(str(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} holds no loadable tokenizer ({str(err).splitlines()[0]})") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer in {path} has no eos token; answers need one to end")
    return tokenizer
