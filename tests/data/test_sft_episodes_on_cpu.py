"""SFT on multi-turn episodes (issue 31's calculator warm start): an answer given as turns is the episode's tokens,
and the tool's turn takes no loss, as in RL.

The demonstrations are data/arith/sft.jsonl (jobs/sft_calculator_tiny.yaml); their held-out counterpart is the last
``arith.VALIDATION`` rows of data/arith/prompts.jsonl (bench/multi_turn_eval.py).
"""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from restage.algorithms import sft
from restage.algorithms.environments import EpisodeContext, SpelledToolUse
from restage.config.sections import EnvironmentConfig
from restage.data import arith, datasets
from restage.data.tokenizer import load_tokenizer
from restage.errors import ConfigError
from restage.runtime.step.episode_feed import observation_ids

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "arith"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED / "tokenizer")


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (SHIPPED / name).read_text().splitlines()]


def test_multi_turn_sft_demonstrations_are_right_reproducible_and_none_is_held_out(tmp_path):
    out = arith.make(tmp_path / "arith")
    for name in ("prompts.jsonl", "sft.jsonl", "tokenizer/tokenizer.json"):
        assert filecmp.cmp(out / name, SHIPPED / name, shallow=False), name
    demos, held_out = _rows("sft.jsonl"), {r["prompt"] for r in _rows("prompts.jsonl")[-arith.VALIDATION:]}
    prompts = [r["prompt"] for r in demos]
    assert len(prompts) == len(set(prompts)) == arith.DEMOS and not set(prompts) & held_out
    assert len(held_out) > 50  # the held-out rows are mostly distinct prompts: the disjointness is not vacuous
    assert all([t["role"] for t in r["answer"]] == ["assistant", "tool", "assistant"] for r in demos)
    assert arith.correct(prompts, [r["answer"][2]["content"] for r in demos]) == [True] * len(demos)


def test_multi_turn_sft_demonstration_is_the_tool_call_episode_the_environment_plays(tokenizer):
    row = _rows("sft.jsonl")[0]
    call, tool, answer = (t["content"] for t in row["answer"])
    opts = EnvironmentConfig(name="tool_use_spelled", tools=("calculator",), tool_call_reward=0.3)
    env = SpelledToolUse(EpisodeContext(row["prompt"], {}, 0, opts, reward_fn=arith.reward, namespaces=False))
    first = env.step(call)
    assert (first.observation, first.done) == (tool, False)  # the sandboxed calculator's output, as demonstrated
    last = env.step(answer)
    assert (last.reward, last.done) == (pytest.approx(1.3), True)
    example, = datasets.tokenize([row], "sft", tokenizer, 9, 16)
    episode = [*tokenizer.encode(call, add_special_tokens=False), *observation_ids(tokenizer, first.observation),
               *tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
    assert list(example.answers[0]) == episode  # the tokens an RL episode of the same turns has
    n_call = len(tokenizer.encode(call, add_special_tokens=False))
    n_tool = len(observation_ids(tokenizer, tool))
    assert example.observed == (False,) * n_call + (True,) * n_tool + (False,) * (len(episode) - n_call - n_tool)


def test_multi_turn_sft_loss_has_no_gradient_on_tool_call_observation_tokens(tokenizer):
    rows = _rows("sft.jsonl")[:3]
    batch = datasets.collate(datasets.tokenize(rows, "sft", tokenizer, 9, 16), "sft")
    ids = batch["packed_input_ids"]
    observation = torch.zeros_like(ids, dtype=torch.bool)
    start = 0
    for n in batch.seqlens:  # the tokens from <result> to </result> of each episode, found by their words
        words = tokenizer.convert_ids_to_tokens(ids[start:start + n].tolist())
        observation[start + words.index("<result>"):start + words.index("</result>") + 1] = True
        start += n
    prompt = batch["prompt_mask"].bool() & ~observation
    assert int(observation.sum()) == sum(len(r["answer"][1]["content"].split()) for r in rows)
    logprobs = torch.full(ids.shape, -1.0, requires_grad=True)
    value, stats = sft.loss("actor_train", batch, {"logprobs": logprobs}, None, None)
    value.backward()
    grad = logprobs.grad
    assert torch.equal(grad[observation], torch.zeros(int(observation.sum())))
    assert torch.equal(grad[prompt], torch.zeros(int(prompt.sum())))
    policy = ~batch["prompt_mask"].bool()
    assert bool((grad[policy] < 0).all()) and stats["answer_tokens"] == int(policy.sum()) == len(ids) - 3 * 7 - int(
        observation.sum())


def test_multi_turn_sft_turns_with_a_chat_template_are_refused_in_one_line(tokenizer):
    row = _rows("sft.jsonl")[0]
    with pytest.raises(ConfigError, match=r"^line 1: an answer given as turns is read as plain text; set "
                                          r"dataset.chat_template=false$"):
        datasets.tokenize([row], "sft", tokenizer, 9, 16, chat_template=True)
    with pytest.raises(ConfigError, match="an SFT answer may be a list of turns"):
        datasets.tokenize([{**row, "chosen": row["answer"], "rejected": "1"}], "preference", tokenizer, 9, 16)
