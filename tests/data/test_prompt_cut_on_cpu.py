"""Prompts longer than dataset.max_prompt_tokens are cut as before, and the run says how many in one line; a
tokenizer without a chat template is refused naming both places transformers keeps one."""

import json
from pathlib import Path

import pytest

from restage.config.load import config_from_dict
from restage.data import datasets
from restage.data.chat import encode_prompt, prompt_ids
from restage.data.tokenizer import load_tokenizer
from restage.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "synthetic" / "tokenizer"


def _cfg(path, **dataset):
    return config_from_dict({"experiment": "x", "algorithm": "grpo", "models": {"actor": {"path": "p"}},
                             "dataset": {"path": str(path), "tokenizer": str(TOKENIZER), "max_prompt_tokens": 16,
                                         **dataset}})


def test_a_long_prompt_is_cut_as_before_and_counted_in_one_warning_line(tmp_path):
    tokenizer = load_tokenizer(TOKENIZER)
    huge = "sort " + " ".join("7" for _ in range(200_000)) + " :"  # 1.2 MB of text, 200,002 tokens
    rows = [{"prompt": "sort 3 1 :"}, {"prompt": huge}, {"prompt": "sort " + "1 " * 20 + ":"}, {"prompt": "sort 2 :"}]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train, held_out = datasets.load_splits(_cfg(path, eval_fraction=0.25), tokenizer)
    assert [len(e.prompt) for e in train.examples + held_out.examples] == [5, 16, 16, 4]
    for example, row in zip(train.examples, rows, strict=False):  # the cut is the one of before
        assert example.prompt == encode_prompt(tokenizer, row["prompt"], 16) == prompt_ids(tokenizer, row["prompt"],
                                                                                            16, False)
    assert train.cut_prompts == ((str(path), 2, 200_003), (str(path), 3, 23)) and held_out.cut_prompts == ()
    warning = datasets.cut_prompts_warning(_cfg(path), train, held_out)
    assert warning == (f"warning: 2 of 4 prompts are longer than dataset.max_prompt_tokens=16 and are cut from the "
                       f"left (the longest: {path}:2, 200,003 tokens); raise dataset.max_prompt_tokens to keep them "
                       "whole, or shorten them")
    short, _ = datasets.load_splits(_cfg(path, max_prompt_tokens=300_000), tokenizer)
    assert short.cut_prompts == () and datasets.cut_prompts_warning(_cfg(path), short) == ""


def test_no_chat_template_names_chat_template_jinja_and_tokenizer_config(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "sort 3 1 :"}) + "\n")
    with pytest.raises(ConfigError) as err:
        datasets.load_splits(_cfg(path, chat_template=True), load_tokenizer(TOKENIZER))
    message = str(err.value)
    assert "chat_template.jinja" in message and "tokenizer_config.json" in message and "\n" not in message
    assert "set dataset.chat_template=false" in message
