"""docs/algorithms.md's worked example (a Qwen-style checkpoint with a chat template, a parquet question/answer
file, the math reward, TensorBoard) runs as written, and its parts do what the page says."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from restage.algorithms.base import CallContext
from restage.algorithms.interface import get_algorithm
from restage.config.load import load_config
from restage.data.batch import pack_sequences
from restage.data.datasets import load_splits, sample_fields
from restage.data.tokenizer import load_tokenizer
from restage.report.log import read_log

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- (example-file: (?P<file>\S+)|example-run) -->\n```\w*\n(?P<code>.*?)```", re.S)


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The page's files written into a fresh directory, and its commands run there, as a user would."""
    where = tmp_path_factory.mktemp("example")
    blocks = list(BLOCK.finditer((ROOT / "docs" / "algorithms.md").read_text()))
    files = {m["file"]: m["code"] for m in blocks if m["file"]}
    runs = [m["code"] for m in blocks if not m["file"]]
    assert set(files) == {"make_math_example.py", "grpo_math.yaml"} and len(runs) == 1
    for name, code in files.items():
        (where / name).write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    commands = [line.split("#")[0].split() for line in runs[0].splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["python", "make_math_example.py"], ["restage", "run"], ["tensorboard", "--logdir"]]
    for command in commands[:2]:  # the dashboard server is for a person to look at
        argv = [sys.executable, *command[1:]] if command[0] == "python" else [sys.executable, "-m", "restage.cli",
                                                                                *command[1:]]
        done = subprocess.run(argv, cwd=where, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return where


def test_tensorboard_holds_the_logs_scalars(example):
    trial = example / "results" / "grpo-math" / "default"
    series = read_log(trial).stat_series()
    board = tensorboard_scalars(trial / "tensorboard")
    assert {"actor_train/reward", "actor_train/loss", "actor_train/kl", "eval/reward", "eval/accuracy"} <= set(series)
    for name, (steps, values) in series.items():
        assert [s for s, _ in board[name]] == steps.tolist(), name
        assert np.array_equal(np.float32([v for _, v in board[name]]), values.astype(np.float32)), name
    assert series["eval/accuracy"][0].tolist() == [20, 40]
    rewards = series["actor_train/reward"][1]
    assert len(rewards) == 40 and np.all((rewards >= 0) & (rewards <= 1))
    assert np.allclose(rewards * 64, np.round(rewards * 64))  # 0/1 rewards over 8 prompts x 8 answers
    assert {f"time/{m}_seconds" for m in ("actor_gen", "ref_inf", "actor_train")} <= set(board)


def test_prompts_are_the_chat_template_and_the_math_reward_reads_each_rows_answer(example, monkeypatch):
    monkeypatch.chdir(example)
    cfg = load_config("grpo_math.yaml")
    tokenizer = load_tokenizer("assets/qwen-math")
    train, held_out = load_splits(cfg)
    assert (len(train), len(held_out)) == (49, 6)  # round(55 * 0.1)
    import pyarrow.parquet as pq

    rows = pq.read_table("math.parquet").to_pylist()
    for example_ in train.examples + held_out.examples:
        own = tokenizer.apply_chat_template([{"role": "user", "content": rows[example_.index]["question"]}],
                                            add_generation_prompt=True, tokenize=True)["input_ids"]
        assert list(example_.prompt) == list(own)
        assert dict(example_.fields) == {"answer": rows[example_.index]["answer"]}
    assert " ".join(tokenizer.convert_ids_to_tokens(list(train.examples[7].prompt))) == \
        "<|im_start|> user what is 0 + 7 ? <|im_end|> <|im_start|> assistant"

    # The runtime's path: after_generate attaches the math reward, given each sample's fields.
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    call = CallContext(sample_fields=sample_fields(train, held_out))
    eos = tokenizer.eos_token_id
    ids = [7, 24]  # what is 0 + 7 ?  and  what is 2 + 5 ?  (both 7)
    answers = {7: ["7", "6"] + ["7"] * 6, 24: ["7", "3 + 4 = 7"] + ["7"] * 6}  # 8 answers per prompt (group_size)
    seqs, prompt_lens = [], []
    for i in ids:
        prompt = list(train.examples[i].prompt)
        for text in answers[i]:
            seqs.append(prompt + tokenizer.encode(text, add_special_tokens=False) + [eos])
            prompt_lens.append(len(prompt))
    batch = pack_sequences(seqs, group_size=8, prompt_lens=prompt_lens, ids=ids)
    batch = batch.with_keys(tokens={"logprobs": torch.zeros(batch.n_tokens)})
    scored = algo.after_generate("actor_gen", batch, cfg, state, call)["rewards"]
    assert rows[7]["answer"] == "7" and rows[24]["answer"] == "7"
    assert scored.tolist() == [1.0, 0.0] + [1.0] * 6 + [1.0, 1.0] + [1.0] * 6
    call = CallContext(sample_fields={7: {"answer": "6"}, 24: {"answer": "4"}})  # other references: other scores
    assert algo.after_generate("actor_gen", batch, cfg, state, call)["rewards"].tolist() == [0.0, 1.0] + [0.0] * 14
