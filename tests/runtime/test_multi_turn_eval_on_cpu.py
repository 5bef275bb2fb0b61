"""Held-out evaluation of a multi-turn job scores episodes (issue 31): ``evaluate.episode_sums`` over finished
episodes, the final answer being what the policy wrote after the last observation."""

from pathlib import Path

import pytest

from restage.algorithms.rewards import resolve_accuracy
from restage.data.tokenizer import load_tokenizer
from restage.runtime.step.evaluation import episode_sums
from restage.runtime.step.multi_turn import EpisodeRecord, final_answer

ARITH = Path(__file__).resolve().parents[2] / "data" / "arith"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ARITH / "tokenizer")


def record(tokenizer, parts: list[tuple[str, bool]], reward: float, turns: int, calls: int, ok: int,
           final_score: float | None) -> EpisodeRecord:
    """An episode of ``(text, written by the policy)`` parts; the first part is the prompt (BOS first)."""
    ids, policy = [tokenizer.bos_token_id], [False]
    for text, mine in parts:
        part = tokenizer.encode(text, add_special_tokens=False)
        ids += part
        policy += [mine] * len(part)
    ids.append(tokenizer.eos_token_id)  # the last turn's EOS, written by the policy
    policy.append(True)
    prompt_len = 1 + len(tokenizer.encode(parts[0][0], add_special_tokens=False))
    return EpisodeRecord(tuple(ids), tuple(policy), (0.0,) * len(ids), prompt_len, reward, turns, calls, ok, False,
                         final_score)


def test_multi_turn_eval_sums_score_the_final_answer_after_the_last_observation(tokenizer):
    called = record(tokenizer, [("compute 7 * 4 8 :", False), ("<call> 7 * 4 8 </call>", True),
                                ("<result> 3 3 6 </result>", False), ("3 3 6", True)], 1.3, 2, 1, 1, 1.0)
    # No call: the whole answer is the final one; wrong ("3 3 5" is not 7 x 48).
    guessed = record(tokenizer, [("compute 7 * 4 8 :", False), ("3 3 5", True)], 0.25, 1, 0, 0, 0.25)
    # A call that failed (its observation an error line), then a right answer: right, but no call that ran.
    failed = record(tokenizer, [("compute 2 * 1 2 :", False), ("<call> 2 * </call>", True),
                                ("<result> </result>", False), ("2 4", True)], 1.0, 2, 1, 0, 1.0)
    assert tokenizer.decode(list(final_answer(called)), skip_special_tokens=True) == "3 3 6"
    assert tokenizer.decode(list(final_answer(guessed)), skip_special_tokens=True) == "3 3 5"
    sums = episode_sums([called, guessed, failed], tokenizer, resolve_accuracy("restage.data.arith:reward"))
    assert sums == pytest.approx({"reward": 1.3 + 0.25 + 1.0, "prompts": 3.0, "turns": 5.0, "tool_call_rate": 1.0,
                                  "final_score": 2.25, "accuracy": 2.0,
                                  # policy tokens: 6 + 3 + 1 EOS; 3 + EOS; 4 + 2 + EOS
                                  "length": 10.0 + 4 + 7})
    # Without a right-or-wrong test there is no accuracy; without tool_use's final score, none either.
    bare = episode_sums([EpisodeRecord(**{**called.__dict__, "final_score": None})], tokenizer, None)
    assert set(bare) == {"reward", "prompts", "turns", "tool_call_rate", "length"}


def test_the_arith_reward_by_name_or_by_module_path_has_its_right_or_wrong_test():
    by_name, by_path = resolve_accuracy("arith"), resolve_accuracy("restage.data.arith:reward")
    assert by_name is not None and by_path is not None
    assert by_path(["compute 7 * 4 8 :"] * 2, ["3 3 6", "3 3 5"]) == [True, False]
    assert resolve_accuracy("restage.data.tasks:reward") is not None  # the sort task, by its module path
    assert resolve_accuracy("restage.data.arith:score") is None
