import filecmp
import json
from pathlib import Path

import pytest

from restage.config.load import config_from_dict
from restage.data import datasets, make, sources, tasks
from restage.data.tokenizer import load_tokenizer
from restage.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "data" / "synthetic"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED / "tokenizer")


def test_shipped_tokenizer_loads_with_auto_tokenizer(tokenizer):
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(str(SHIPPED / "tokenizer"))
    assert len(again) == len(tasks.VOCAB) == 16
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)
    ids = again.encode("sort 3 1 :", add_special_tokens=False)
    assert ids == [tasks.VOCAB.index(w) for w in ("sort", "3", "1", ":")]
    assert again.decode([1] + ids + [2], skip_special_tokens=True) == "sort 3 1 :"


def test_make_reproduces_the_shipped_files(tmp_path):
    out = make.make(tmp_path / "synthetic")
    for name in ("prompts.jsonl", "sft.jsonl", "preference.jsonl", "tokenizer/tokenizer.json"):
        assert filecmp.cmp(out / name, SHIPPED / name, shallow=False), name
    total_bytes = sum(p.stat().st_size for p in SHIPPED.rglob("*") if p.is_file())
    assert total_bytes < 400_000


def test_task_reward_by_hand_and_preferences_prefer_chosen():
    assert tasks.score("sort 3 1 2 :", "1 2 3") == 1.0
    # right digit 1; a digit 1 away: 0.5 * (1 - 1/9); a non-digit 0
    assert tasks.score("sort 3 1 2 :", "1 3 2") == pytest.approx((1 + 2 * 0.5 * 8 / 9) / 3)
    assert tasks.score("sort 3 1 2 :", "1 : 9") == pytest.approx((1 + 0 + 0.5 * 3 / 9) / 3)
    assert tasks.score("sort 3 1 2 :", "1 2 3 3 3 3") == pytest.approx(3 / 6)
    assert tasks.score("sort 3 1 2 :", "") == 0.0
    assert tasks.reward(["sort 5 4 :"], ["4 5"]) == [1.0]
    rows = [json.loads(line) for line in (SHIPPED / "preference.jsonl").read_text().splitlines()]
    assert all(tasks.score(r["prompt"], r["chosen"]) == 1.0 > tasks.score(r["prompt"], r["rejected"]) for r in rows)
    sft = [json.loads(line) for line in (SHIPPED / "sft.jsonl").read_text().splitlines()]
    assert all(tasks.score(r["prompt"], r["answer"]) == 1.0 for r in sft)


def test_load_splits_tokenises_truncates_and_collates(tokenizer):
    cfg = config_from_dict({"experiment": "x", "algorithm": "dpo", "models": {"actor": {"path": "p"}},
                            "dataset": {"path": str(SHIPPED / "preference.jsonl"), "kind": "preference",
                                        "tokenizer": str(SHIPPED / "tokenizer"), "max_prompt_tokens": 5,
                                        "max_answer_tokens": 4, "eval_fraction": 0.1}})
    train, held_out = datasets.load_splits(cfg)
    assert (len(train), len(held_out)) == (1350, 150)
    assert held_out.examples[0].index == 1350
    example = train.examples[0]  # {"prompt": "sort 4 3 0 0 :", "chosen": "0 0 3 4", "rejected": "0 4 3 0"}
    v = tasks.VOCAB.index
    assert example.prompt == (1, v("3"), v("0"), v("0"), v(":"))  # BOS kept, cut from the left
    assert example.answers[0] == (v("0"), v("0"), v("3"), v("4"))  # cut from the right: EOS dropped
    batch = train.batch([0, 1])
    assert batch.group_size == 2 and batch.n_seqs == 4 and batch.ids == (0, 1)
    assert batch.seqlens[:2] == (9, 9)
    assert batch["prompt_mask"][:9].tolist() == [True] * 5 + [False] * 4


def test_prompt_and_sft_layouts(tokenizer):
    rows = [{"prompt": "sort 2 1 :", "answer": "1 2"}]
    [ex] = datasets.tokenize(rows, "sft", tokenizer, 16, 16)
    batch = datasets.collate([ex], "sft")
    assert batch["packed_input_ids"].tolist() == [1, *[tasks.VOCAB.index(w) for w in "sort 2 1 : 1 2".split()], 2]
    assert batch["prompt_mask"].tolist() == [True] * 5 + [False] * 3
    assert datasets.collate([ex], "prompt")["prompts"].tolist() == [1, 14, 6, 5, 15]
    for limit in range(1, 8):  # every prompt length around the limit: BOS + the last limit - 1 tokens
        [ex] = datasets.tokenize(rows, "sft", tokenizer, limit, 2)
        assert ex.prompt == (1, 14, 6, 5, 15)[:1] + (14, 6, 5, 15)[max(0, 4 - (limit - 1)):]
        assert ex.answers[0] == (5, 6)  # "1 2" + EOS, cut to 2 tokens


def test_cursor_walks_epochs_and_restores():
    cursor = datasets.Cursor(size=10, seed=3)
    first = [cursor.next(4), cursor.next(4)]
    assert len(set(first[0] + first[1])) == 8
    third = cursor.next(4)  # leftover of 2 is skipped: a new epoch starts
    assert cursor.epoch == 1 and len(third) == 4
    saved = cursor.state_dict()
    again = datasets.Cursor(size=10, seed=3)
    again.load_state_dict(saved)
    assert again.next(4) == cursor.next(4)
    with pytest.raises(ConfigError, match="exceeds the 10 examples"):
        cursor.next(11)


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ('{"prompt": "a"}\n{"answer": "b"}\n', r"bad.jsonl:1: missing field 'answer'"),
    ('{"prompt": "a", "answer": "b"}\n\n{"prompt": "a", "answer": 3}\n', r"bad.jsonl:3: field 'answer' must be a string"),
    ('{"prompt": "a", "answer": "b"}\n{oops\n', r"bad.jsonl:2: not valid JSON"),
    ("", "holds no rows"),
])
def test_data_errors_are_one_line_with_the_line_number(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        sources.read_jsonl(path, ("prompt", "answer"))
    assert "\n" not in str(err.value)


def test_a_file_that_is_not_utf8_is_refused_naming_line_and_byte(tmp_path):
    good = '{"prompt": "café", "answer": "b"}\n'.encode()
    bad = '{"prompt": "café", "answer": "b"}\n'.encode("latin-1")  # é is one byte 0xe9 here
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + bad)
    with pytest.raises(ConfigError) as err:
        sources.read_jsonl(path, ("prompt", "answer"))
    assert str(err.value) == f"{path}:2: not UTF-8 (byte {len(good) + bad.index(0xE9)} of the file, 0xe9); save the " \
                             "file as UTF-8"
    path.write_bytes(good + good)
    assert sources.read_jsonl(path, ("prompt", "answer")) == [{"prompt": "café", "answer": "b"}] * 2


def test_missing_tokenizer_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer directory .* does not exist"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no loadable tokenizer"):
        load_tokenizer(tmp_path / "empty")
