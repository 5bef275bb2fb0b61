"""Verifiable rewards: the math checker on a hand-written table, format, and batch scoring (fields as keywords,
threads, a reward that raises or returns NaN)."""

import math
import threading
import time

import pytest
import torch

from restage.algorithms import base, rewards, scoring, verifiers
from restage.config.load import config_from_dict
from restage.config.sections import RewardsConfig
from restage.data.batch import pack_sequences
from restage.errors import ConfigError, RewardError

# The math checker's table, written by hand: (completion, reference, equal?)
TABLE = [
    # equivalent forms
    ("The answer is \\boxed{42}.", "42", True),
    ("So we get 42", "42", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{1/2}", "\\frac12", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{2x+2}", "2(x+1)", True),
    ("\\boxed{-3}", "-3", True),
    ("The total is 1,000 apples.", "1000", True),
    ("\\boxed{1000}", "1,000", True),
    ("\\boxed{3.0}", "3", True),
    ("\\boxed{\\pi}", "\\pi", True),
    ("\\boxed{2\\pi}", "2\\pi", True),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", True),
    ("\\boxed{6}", "3!", True),
    ("\\boxed{10\\%}", "10", True),
    ("\\boxed{x=5}", "5", True),
    ("First 3, then 4, finally \\boxed{7}", "7", True),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),
    ("\\boxed{(1,2)}", "(1,2)", True),
    ("\\boxed{\\frac{4}{6}}", "\\frac{2}{3}", True),
    ("\\boxed{e^{0}}", "1", True),
    ("\\boxed{\\sqrt{16}}", "4", True),
    ("\\boxed{2^{10}}", "1024", True),
    ("\\boxed{1.5}", "\\frac{3}{2}", True),
    ("\\boxed{-\\frac{1}{3}}", "-1/3", True),
    ("\\boxed{0.333333}", "\\frac{1}{3}", True),
    ("\\boxed{\\infty}", "\\infty", True),
    ("There are 12 eggs, so 12 / 3 = 4. \\boxed{4}", "4", True),
    ("the result: 7.25", "29/4", True),
    ("\\boxed{{5}}", "5", True),
    ("\\boxed{\\text{5}}", "5", True),
    # wrong answers
    ("\\boxed{41}", "42", False),
    ("So we get 43", "42", False),
    ("\\boxed{0.51}", "\\frac{1}{2}", False),
    ("\\boxed{\\frac{1}{3}}", "0.5", False),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("\\boxed{3}", "-3", False),
    ("\\boxed{2\\pi}", "\\pi", False),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", False),
    ("\\boxed{100}", "1000", False),
    ("\\boxed{(2,1)}", "(1,2)", False),
    ("The answer is \\boxed{7}, not 8", "8", False),
    ("\\boxed{2x}", "2(x+1)", False),
    ("\\boxed{1024}", "2^{11}", False),
    ("\\boxed{-\\frac{1}{3}}", "1/3", False),
    ("I think it is 6 or maybe 5", "6", False),
    ("\\boxed{0.3}", "\\frac{1}{3}", False),
    # malformed or missing
    ("I don't know", "42", False),
    ("", "42", False),
    ("\\boxed{", "42", False),
    ("\\boxed{}", "42", False),
    ("\\boxed{\\frac{1}{}}", "1", False),
    ("the answer is forty-two", "42", False),
    ("\\boxed{" + "9" * 400 + "}", "9", False),
    ("}{}{\\boxed{)(}", "1", False),
    ("answer: \\boxed{abc}", "42", False),
]


def test_math_checker_accuracy_on_the_table():
    assert len(TABLE) >= 50
    assert sum(e for _, _, e in TABLE) >= 20 and sum(not e for _, _, e in TABLE) >= 20  # both kinds, and malformed
    reward = rewards.resolve_reward("math", RewardsConfig(reference_field="answer"))
    wrong = [(c, r) for c, r, equal in TABLE if (reward("q", c, answer=r) == 1.0) != equal]
    assert wrong == []  # accuracy 60/60


def test_math_reference_forms_and_field_name():
    reward = rewards.resolve_reward("math", RewardsConfig(reference_field="solution"))
    assert reward("q", "so 18", solution="Janet has 16 - 3 - 4 = 9 eggs; 9 * 2 = 18\n#### 18") == 1.0  # GSM8K's ####
    assert reward("q", "\\boxed{18}", solution="thus \\boxed{18}") == 1.0
    with pytest.raises(KeyError, match="no field 'solution'"):
        reward("q", "18", answer="18")
    assert verifiers.final_answer("a 1, b 2,500.5 then") == "2500.5"
    assert verifiers.last_boxed("\\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"


def test_format_reward_matches_the_whole_answer():
    reward = rewards.resolve_reward("format", RewardsConfig(format_pattern=r"<think>.*</think>\s*<answer>.*</answer>"))
    assert reward("q", "<think>a\nb</think> <answer>3</answer>") == 1.0
    assert reward("q", "<answer>3</answer>") == 0.0
    assert reward("q", "<think>a</think><answer>3</answer> and more") == 0.0
    with pytest.raises(ConfigError, match="needs rewards.format_pattern"):
        rewards.resolve_reward("format", RewardsConfig())
    with pytest.raises(ConfigError, match="not a valid regex"):
        rewards.resolve_reward("format", RewardsConfig(format_pattern="("))
    with pytest.raises(ConfigError, match="format_pattern"):  # refused when the algorithm validates the config
        base.check_reward_source(config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": "format",
                                                   "models": {"actor": {"path": "p"}}}))


def test_a_per_sample_reward_gets_each_samples_fields_on_threads():
    seen, threads = [], set()

    @verifiers.sample_reward
    def echo(prompt, completion, /, **fields):
        time.sleep(0.05)
        threads.add(threading.get_ident())
        seen.append((prompt, completion, fields))
        return fields["bonus"] + len(completion)

    fields_of = {7: {"bonus": 10, "answer": "x"}, 9: {"bonus": 20, "answer": "y"}}
    began = time.perf_counter()
    values = scoring.score(echo, ["p7", "p7", "p9", "p9"], ["a", "bb", "ccc", ""], [7, 7, 9, 9], fields_of,
                           RewardsConfig(workers=4))
    assert values == [11.0, 12.0, 23.0, 20.0]
    assert sorted(seen) == [("p7", "a", {"bonus": 10, "answer": "x"}), ("p7", "bb", {"bonus": 10, "answer": "x"}),
                            ("p9", "", {"bonus": 20, "answer": "y"}), ("p9", "ccc", {"bonus": 20, "answer": "y"})]
    assert len(threads) > 1 and time.perf_counter() - began < 0.15  # four 50 ms calls side by side


def test_a_batched_reward_gets_the_fields_as_lists_only_when_it_takes_kwargs():
    def batched(prompts, answers, **fields):
        return [len(a) + n for a, n in zip(answers, fields["n"])]

    assert scoring.score(batched, ["p", "q"], ["ab", "c"], [0, 1], {0: {"n": 1}, 1: {"n": 5}}) == [3.0, 6.0]
    assert scoring.score(lambda prompts, answers: [1.0] * len(answers), ["p"], ["a"], [0], {0: {"n": 1}}) == [1.0]


def test_a_reward_that_raises_or_is_nan_scores_0_and_is_reported_with_its_sample_id(capsys):
    @verifiers.sample_reward
    def fragile(prompt, completion, /, **fields):
        if completion == "boom":
            raise ValueError("cannot parse")
        return math.nan if completion == "nan" else 1.0

    values = scoring.score(fragile, ["p"] * 3, ["ok", "boom", "nan"], [3, 4, 5], {}, RewardsConfig())
    assert values == [1.0, 0.0, 0.0]
    err = capsys.readouterr().err.splitlines()
    assert err == ["restage: reward fragile: sample 4 raised ValueError: cannot parse; scored 0 (rewards.on_error=stop "
                   "stops the run instead)",
                   "restage: reward fragile: sample 5 returned nan; scored 0 (rewards.on_error=stop stops the run instead)"]
    with pytest.raises(RewardError, match="sample 4 raised ValueError: cannot parse; fix the reward"):
        scoring.score(fragile, ["p"] * 3, ["ok", "boom", "nan"], [3, 4, 5], {}, RewardsConfig(on_error="stop"))
    with pytest.raises(ConfigError, match="on_error"):
        config_from_dict({"experiment": "x", "algorithm": "sft", "models": {"actor": {"path": "p"}},
                          "rewards": {"on_error": "ignore"}})


def test_function_rewards_maps_each_sequence_to_its_samples_fields():
    class Letters:  # a tokenizer of one letter per id, enough for decode
        eos_token_id = 0

        def batch_decode(self, seqs, skip_special_tokens=True):
            return ["".join(chr(96 + t) for t in s) for s in seqs]

    @verifiers.sample_reward
    def matches(prompt, completion, /, **fields):
        return float(completion == fields["answer"])

    # two prompts (ids 11, 12), two answers each: "a" | "b", "b" | "c"
    batch = pack_sequences([[1, 2], [1, 3], [2, 2], [2, 3, 0]], group_size=2, prompt_lens=[1, 1, 1, 1], ids=[11, 12])
    values = rewards.function_rewards(batch, matches, Letters(), "seqs", "prompt_mask",
                                      {11: {"answer": "b"}, 12: {"answer": "c"}}, RewardsConfig())
    assert values.tolist() == [1.0, 0.0, 0.0, 1.0] and values.dtype == torch.float32
