"""A user's data: JSONL, parquet and HF datasets directories, field mapping, pre-tokenised ids, chat templates."""

import json
from pathlib import Path

import pytest

from restage.config.load import config_from_dict
from restage.data import datasets, sources
from restage.data.tokenizer import build_word_tokenizer, load_tokenizer
from restage.errors import CheckpointError, ConfigError
from restage.models.arch import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "synthetic" / "tokenizer"
# The shipped tokenizer's ids: [PAD] [BOS] [EOS] [UNK] 0..9 sort :
V = {w: i for i, w in enumerate(("[PAD]", "[BOS]", "[EOS]", "[UNK]", *"0123456789", "sort", ":"))}
ROWS = [{"question": "sort 3 1 :", "solution": "1 3", "level": 1},
        {"question": "sort 2 0 4 :", "solution": "0 2 4", "level": 2},
        {"question": "sort 9 8 :", "solution": "8 9", "level": 3},
        {"question": "sort 5 5 1 :", "solution": "1 5 5", "level": 4}]
CHATML = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def cfg_for(path, **dataset):
    return config_from_dict({"experiment": "x", "algorithm": "sft", "models": {"actor": {"path": "p"}},
                             "dataset": {"path": str(path), "kind": "sft", "tokenizer": str(TOKENIZER),
                                         "fields": {"prompt": "question", "answer": "solution"}, **dataset}})


def write_all_formats(tmp_path, rows):
    """The same rows as JSONL, parquet, a saved Dataset and a saved DatasetDict (train + test)."""
    import datasets as hf

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "rows.parquet"
    hf.Dataset.from_list(rows).to_parquet(str(parquet))
    hf.Dataset.from_list(rows).save_to_disk(str(tmp_path / "arrow"))
    hf.DatasetDict({"train": hf.Dataset.from_list(rows[:3]), "test": hf.Dataset.from_list(rows[3:])}).save_to_disk(
        str(tmp_path / "dict"))
    return jsonl, parquet, tmp_path / "arrow", tmp_path / "dict"


def test_every_format_gives_the_same_examples_with_mapped_fields(tmp_path):
    jsonl, parquet, arrow, _ = write_all_formats(tmp_path, ROWS)
    loaded = [datasets.load_splits(cfg_for(p))[0] for p in (jsonl, parquet, arrow)]
    first = loaded[0].examples[0]
    assert first.prompt == (V["[BOS]"], V["sort"], V["3"], V["1"], V[":"])
    assert first.answers == ((V["1"], V["3"], V["[EOS]"]),)
    assert first.fields == {"level": 1}  # the columns no role took, for the reward function
    for other in loaded[1:]:
        assert [(e.index, e.prompt, e.answers, dict(e.fields)) for e in other.examples] == \
               [(e.index, e.prompt, e.answers, dict(e.fields)) for e in loaded[0].examples]


def test_held_out_by_fraction_by_split_and_by_path(tmp_path):
    jsonl, parquet, _, dict_dir = write_all_formats(tmp_path, ROWS)
    train, held_out = datasets.load_splits(cfg_for(jsonl, eval_fraction=0.25))
    assert [e.index for e in train.examples] == [0, 1, 2] and [e.index for e in held_out.examples] == [3]
    train, held_out = datasets.load_splits(cfg_for(dict_dir, eval_split="test"))
    assert [e.index for e in train.examples] == [0, 1, 2] and [e.index for e in held_out.examples] == [3]
    assert held_out.examples[0].prompt == (V["[BOS]"], V["sort"], V["5"], V["5"], V["1"], V[":"])
    train, held_out = datasets.load_splits(cfg_for(jsonl, eval_path=str(parquet)))
    assert (len(train), len(held_out)) == (4, 4) and held_out.examples[0].index == 4  # one id space
    assert sorted(datasets.sample_fields(train, held_out)) == list(range(8))
    with pytest.raises(ConfigError, match="no split 'validation'; it has train, test"):
        datasets.load_splits(cfg_for(dict_dir, split="validation"))
    with pytest.raises(ConfigError, match="not several"):
        cfg_for(jsonl, eval_fraction=0.5, eval_path=str(parquet))


def test_pretokenised_ids_are_taken_as_given(tmp_path):
    path = tmp_path / "ids.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 14, 7, 15]}) + "\n" + json.dumps({"token_ids": [14, 9, 15]}) + "\n")
    cfg = config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": "sort", "models": {"actor": {"path": "p"}},
                            "dataset": {"path": str(path), "tokenizer": str(TOKENIZER), "max_prompt_tokens": 3}})
    train, _ = datasets.load_splits(cfg)
    assert [e.prompt for e in train.examples] == [(1, 7, 15), (14, 9, 15)]  # cut from the left, BOS kept
    rows = sources.select_roles([{"prompt": "sort 1 :", "answer": [5, 6]}], "sft", {}, "x")
    tokenizer = load_tokenizer(TOKENIZER)
    assert datasets.tokenize(rows, "sft", tokenizer, 8, 8)[0].answers == ((5, 6, V["[EOS]"]),)


def test_a_missing_field_names_the_fields_the_file_has(tmp_path):
    jsonl, parquet, arrow, _ = write_all_formats(tmp_path, ROWS)
    for path in (jsonl, parquet, arrow):
        with pytest.raises(ConfigError) as err:
            datasets.load_splits(cfg_for(path, fields={"prompt": "query", "answer": "solution"}))
        message = str(err.value)
        assert f"{path}:1: missing field 'query' (dataset.fields.prompt)" in message
        assert "'question', 'solution', 'level'" in message and "\n" not in message
    with pytest.raises(ConfigError, match="missing field 'answer' for the answer; the rows have 'question'"):
        datasets.load_splits(cfg_for(jsonl, fields={"prompt": "question"}))
    with pytest.raises(ConfigError, match="must be text, chat messages"):
        sources.select_roles([{"prompt": 3}], "prompt", {}, "f.jsonl")


def test_hub_ids_get_the_local_directory_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for call, error in ((lambda: sources.read_rows("openai/gsm8k"), ConfigError),
                        (lambda: load_tokenizer("Qwen/Qwen2-0.5B"), ConfigError),
                        (lambda: ModelConfig.from_pretrained("Qwen/Qwen2-0.5B"), CheckpointError)):
        with pytest.raises(error) as err:
            call()
        assert "looks like a HF hub id, but restage loads only local directories" in str(err.value)
        assert "huggingface-cli download" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        sources.read_rows(tmp_path / "nope.jsonl")
    assert "hub id" not in str(err.value)


@pytest.fixture()
def chat_tokenizer(tmp_path):
    vocab = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant",
             "be", "brief", *"0123456789", "sort", ":"]
    path = build_word_tokenizer(vocab, tmp_path / "chat-tokenizer")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return load_tokenizer(path)


def test_chat_template_equals_the_tokenizers_own(tmp_path, chat_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "sort 3 1 :"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": "sort 3 1 :"}) + "\n" + json.dumps({"prompt": messages}) + "\n")
    cfg = config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": "sort", "models": {"actor": {"path": "p"}},
                            "dataset": {"path": str(path), "tokenizer": str(tmp_path / "chat-tokenizer"),
                                        "chat_template": True, "max_prompt_tokens": 64}})
    train, _ = datasets.load_splits(cfg, chat_tokenizer)

    def own(msgs):
        return list(chat_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)["input_ids"])

    assert list(train.examples[0].prompt) == own([{"role": "user", "content": "sort 3 1 :"}])
    assert list(train.examples[1].prompt) == own(messages)
    assert chat_tokenizer.decode(train.examples[1].prompt) == \
        "<|im_start|> system be brief <|im_end|> <|im_start|> user sort 3 1 : <|im_end|> <|im_start|> assistant"
    for room in (len(own(messages)), len(own(messages)) + 1, 2 * len(own(messages)) - 1):  # no cut
        assert datasets.tokenize([{"prompt": messages}], "prompt", chat_tokenizer, room, 8, 0, True)[0].prompt == \
            tuple(own(messages))
    cut = datasets.tokenize([{"prompt": messages}], "prompt", chat_tokenizer, 5, 8, 0, True)[0].prompt
    assert cut == tuple(own(messages)[-5:])  # from the left, as text prompts are
    with pytest.raises(ConfigError, match="set dataset.chat_template=true"):
        datasets.load_splits(config_from_dict({**cfg.to_dict(), "dataset": {**cfg.to_dict()["dataset"],
                                                                             "chat_template": False}}), chat_tokenizer)
    with pytest.raises(ConfigError, match="has no chat_template"):
        datasets.load_splits(cfg, load_tokenizer(TOKENIZER))


def test_a_word_level_tokenizer_in_a_qwen2_checkpoint_keeps_its_words(tmp_path):
    """transformers 5's AutoTokenizer would re-build it as Qwen2Tokenizer (byte-level BPE) and drop the words."""
    from restage.models.tiny import tiny_hf_config

    path = build_word_tokenizer(["[PAD]", "[BOS]", "[EOS]", "[UNK]", "what", "is", "7"], tmp_path / "qwen")
    tiny_hf_config("qwen2", vocab_size=7).save_pretrained(str(path))
    tokenizer = load_tokenizer(path)
    assert tokenizer.encode("what is 7", add_special_tokens=False) == [4, 5, 6]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
