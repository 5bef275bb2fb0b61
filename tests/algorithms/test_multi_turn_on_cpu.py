"""Multi-turn episodes, the algorithm side: observation tokens take no gradient and count nowhere; tool calls are
parsed in both formats and run in the sandbox; bad input is one line each (issue 31, items 2 and 4)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from restage.algorithms import base, estimators, packed_ops
from restage.algorithms.environments import (
    EnvironmentError,
    EpisodeContext,
    SpelledToolUse,
    StepResult,
    ToolUse,
    check_reset,
    check_step,
    validate,
)
from restage.algorithms.interface import build_graph, get_algorithm
from restage.algorithms.rewards import resolve_reward
from restage.algorithms.sandbox import Limits
from restage.algorithms.tools import ToolCall, parse_tool_calls, resolve_tools, run_tool
from restage.config.load import config_from_dict, load_config
from restage.config.sections import EnvironmentConfig
from restage.data import arith
from restage.data.batch import pack_sequences
from restage.errors import ConfigError

# Two episodes, 1 = written by the policy: prompt, answer, observation, answer (and a second with two observations).
POLICY = [[0, 0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 0, 1, 0, 0, 0, 1, 1, 0, 1, 1]]
VOCAB = 12


def _episodes(group: int = 2):
    torch.manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (len(p),)).tolist() for p in POLICY]
    batch = pack_sequences(seqs, group_size=group, prompt_lens=[len(s) for s in seqs], ids=list(range(2 // group)))
    not_policy = torch.tensor([not x for p in POLICY for x in p])
    n = batch.n_tokens
    return batch.with_keys(tokens={"prompt_mask": not_policy, "logprobs": -torch.rand(n) * not_policy.logical_not(),
                                   "ref_logprobs": -torch.rand(n), "values": torch.randn(n)},
                           seqs={"rewards": torch.tensor([1.0, 0.25])})


def _predicts_observation(batch) -> torch.Tensor:
    """``[T]`` bool: logits row r predicts token r + 1 of its sequence, and that token was not the policy's."""
    mask = base.answer_mask(batch)
    nxt = torch.roll(~mask, -1)
    last = torch.zeros_like(mask)
    last[batch.cu_seqlens[1:].long() - 1] = True
    return nxt & ~last


def _cfg(algorithm: str, **algo):
    models = {"actor": {"path": "x", "trainable": True}, "ref": {"path": "x"}}
    if algorithm == "ppo":
        models["critic"] = {"path": "x", "trainable": True}
    return config_from_dict({"experiment": "t", "algorithm": algorithm, "reward_fn": "sort", "models": models,
                             "algo": algo})


@pytest.mark.parametrize("algorithm, algo", [
    ("grpo", {"group_size": 2, "kl_coef": 0.1, "kl_estimator": "k3", "entropy_coef": 0.01}),
    ("ppo", {"kl_coef": 0.1, "entropy_coef": 0.01}),
])
def test_multi_turn_observation_logits_get_exactly_zero_gradient(algorithm, algo):
    cfg = _cfg(algorithm, **algo)
    algorithm_ = get_algorithm(cfg.algorithm)
    state = algorithm_.init_state(cfg)
    batch, stats = algorithm_.prepare_train(_episodes(), cfg, state)
    logits = torch.randn(batch.n_tokens, VOCAB, requires_grad=True)
    outputs = {"logprobs": packed_ops.token_logprobs(logits, batch["seqs"], batch.cu_seqlens),
               "entropy": packed_ops.token_entropy(logits, batch.cu_seqlens)}
    loss, loss_stats = algorithm_.loss("actor_train", batch, outputs, cfg, state)
    loss.backward()
    grad = logits.grad.abs().sum(-1)
    observed = _predicts_observation(batch)
    assert observed.sum() == 9  # rows predicting the prompts' 2 + 1 later tokens and the 2 + 4 observation tokens
    assert (grad[observed] == 0).all(), grad[observed]
    mask = base.answer_mask(batch)
    predicts_policy = torch.roll(mask, -1) & ~observed
    predicts_policy[batch.cu_seqlens[1:].long() - 1] = False
    assert (grad[predicts_policy] > 0).all()  # the gradient reaches every token the policy wrote
    assert stats["answer_tokens"] == sum(map(sum, POLICY))  # length statistics count the policy's tokens only
    assert (batch["advantages"][~mask] == 0).all()


def test_multi_turn_critic_gets_no_gradient_on_observation_states():
    cfg = _cfg("ppo", kl_coef=0.1, value_clip_eps=0.0)
    algorithm = get_algorithm("ppo")
    state = algorithm.init_state(cfg)
    batch, _ = algorithm.prepare_train(_episodes(1), cfg, state)
    values = torch.randn(batch.n_tokens, requires_grad=True)
    loss, _ = algorithm.loss("critic_train", batch, {"values": values}, cfg, state)
    loss.backward()
    observed = _predicts_observation(batch)
    assert (values.grad[observed] == 0).all() and (values.grad != 0).sum() == sum(map(sum, POLICY))


def test_multi_turn_gae_steps_over_observations_as_if_they_were_not_there():
    batch = _episodes(1)
    mask = base.answer_mask(batch)
    rewards, values = torch.randn(batch.n_tokens), torch.randn(batch.n_tokens)
    adv, ret = estimators.gae(rewards * mask, values * mask, mask, batch.cu_seqlens, 0.9, 0.8)
    for i, (lo, hi) in enumerate(zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist())):
        keep = mask[lo:hi]
        compact = torch.tensor([0, int(keep.sum())], dtype=torch.int32)
        want, _ = estimators.gae(rewards[lo:hi][keep], values[lo:hi][keep], torch.ones(int(keep.sum()), dtype=torch.bool),
                                 compact, 0.9, 0.8)
        assert torch.equal(adv[lo:hi][keep], want) and (adv[lo:hi][~keep] == 0).all(), i


def test_tool_call_formats_parse_both_ways():
    template = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 21"}}\n</tool_call> and '
                '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parse_tool_calls(template, "chat_template") == [ToolCall("calculator", {"expression": "2 * 21"}),
                                                           ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("<call> calculator 4 7 * 8 3 </call> then 3 9 0 1", "plain") == [
        ToolCall("calculator", {"input": "4 7 * 8 3"})]
    assert parse_tool_calls("no call here", "plain") == []
    # With one tool its name may be left out; a named call still names it.
    assert parse_tool_calls("<call> 7 * 4 8 </call> <call> calculator 2 </call>", "plain", "calculator") == [
        ToolCall("calculator", {"input": "7 * 4 8"}), ToolCall("calculator", {"input": "2"})]


@pytest.mark.parametrize("text, status, output", [
    ("<call> calculator 4 7 * 8 3 </call>", "ok", "3901"),
    ("<call> abacus 1 + 1 </call>", "unknown_tool", "error: unknown tool 'abacus'; the tools are calculator, python"),
    ("<call> calculator import os </call>", "malformed", "error: calculator takes digits and + - * / % ( ) only, got "
                                                          "'import os'"),
    ("<call> calculator 1 / 0 </call>", "error", "error: calculator failed: ZeroDivisionError: division by zero"),
    ("<call> python raise KeyError(7) </call>", "error", "error: python failed: KeyError: 7"),
    ("<call> python while True: pass </call>", "timeout", "error: python timed out after 1 s"),
])
def test_tool_call_runs_in_the_sandbox_and_every_failure_is_one_line(text, status, output):
    call, = parse_tool_calls(text, "plain")
    result = run_tool(call, resolve_tools(["calculator", "python"]), Limits(timeout_seconds=1.0), namespaces=False)
    assert (result.status, result.output) == (status, output)
    assert "\n" not in result.output


def test_tool_call_malformed_json_is_one_line():
    call, = parse_tool_calls("<tool_call>{name: calculator}</tool_call>", "chat_template")
    result = run_tool(call, resolve_tools(["calculator"]), Limits())
    assert result.status == "malformed" and result.output.startswith("error: the tool call is not JSON (")


def _context(prompt: str, **options) -> EpisodeContext:
    opts = EnvironmentConfig(name="tool_use_spelled", tools=("calculator",), tool_call_reward=0.25,
                             failed_call_reward=-0.5, **options)
    return EpisodeContext(prompt, {}, 0, opts, reward_fn=arith.reward, namespaces=False)


def test_multi_turn_tool_use_episode_by_hand():
    env = SpelledToolUse(_context("compute 4 7 * 8 3 :"))
    assert env.reset() == "compute 4 7 * 8 3 :"
    first = env.step("<call> calculator 4 7 * 8 3 </call>")
    assert (first.observation, first.reward, first.done) == ("<result> 3 9 0 1 </result>", 0.0, False)
    second = env.step("<call> abacus 1 </call>")
    assert (second.observation, second.done) == ("<result> error </result>", False)
    last = env.step("3 9 0 1")
    assert (last.reward, last.done, env.final_score) == (0.25 - 0.5 + 1.0, True, 1.0)


def test_multi_turn_tool_use_chat_template_observation_is_tool_messages():
    env = ToolUse(_context("what is 6 * 7?", tool_format="chat_template"))
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert step.observation == [{"role": "tool", "content": "42"}] and not step.done


@pytest.mark.parametrize("value, message", [
    (("obs", 1.0, True), "environment 'tool_use': step() returned tuple; it must return a StepResult(observation, "
                         "reward, done)"),
    (StepResult(7, 1.0, True), "environment 'tool_use': step().observation returned int '7'; it must return text or "
                               'a list of {"role": str, "content": str} messages'),
    (StepResult("", float("nan"), True), "environment 'tool_use': step().reward is nan; it must be a finite number"),
    (StepResult("", "1", True), "environment 'tool_use': step().reward is '1'; it must be a finite number"),
    (StepResult("", 1.0, 1), "environment 'tool_use': step().done is int 1; it must be a bool"),
])
def test_multi_turn_environment_wrong_types_are_one_line(value, message):
    with pytest.raises(EnvironmentError) as err:
        check_step(value, "tool_use")
    assert str(err.value) == message


def test_multi_turn_reset_and_config_refusals_are_one_line():
    with pytest.raises(EnvironmentError, match=r"^environment 'e': reset\(\) returned nothing"):
        check_reset([], "e")
    with pytest.raises(EnvironmentError, match=r"reset\(\) returned dict"):
        check_reset({"role": "user"}, "e")
    with pytest.raises(ConfigError, match=r"^environment.tools: 'abacus' is not a registered tool; use calculator"):
        validate(EnvironmentConfig(name="tool_use", tools=("abacus",)))
    with pytest.raises(ConfigError, match=r"^environment.name: 'nope' is neither a registered environment"):
        validate(EnvironmentConfig(name="nope"))
    with pytest.raises(ConfigError, match=r"^environment.tool_format: 'xml' must be one of chat_template, plain"):
        validate(EnvironmentConfig(name="tool_use", tool_format="xml"))
    with pytest.raises(ConfigError, match=r"^environment.max_turns \(0\)"):
        validate(EnvironmentConfig(name="tool_use", max_turns=0))


def test_multi_turn_code_job_checks_the_final_answer_by_running_the_rows_tests():
    cfg = load_config("jobs/grpo_code_tools.yaml")
    row = json.loads(Path(cfg.dataset.path).read_text().splitlines()[0])
    ctx = EpisodeContext(row["prompt"], row, 0, cfg.environment, cfg.rewards, resolve_reward(cfg.reward_fn, cfg.rewards))
    env = validate(cfg.environment)(ctx)
    code = "def add(a, b):\n    return a + b\nprint(add(2, 3))"
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    tried = env.step(f"Let me try it.\n<tool_call>\n{call}\n</tool_call>")
    assert (tried.observation, tried.done) == ([{"role": "tool", "content": "5"}], False)
    final = env.step("```python\ndef add(a, b):\n    return a + b\n```")
    assert (final.reward, final.done) == (1.0, True)  # both of the row's tests pass in the sandbox
    wrong = validate(cfg.environment)(ctx).step("```python\ndef add(a, b):\n    return a - b\n```")
    assert (wrong.reward, wrong.done) == (0.0, True)


def test_multi_turn_config_refusals_name_the_key():
    cfg = _cfg("grpo", group_size=2, kl_coef=0.0)
    env = EnvironmentConfig(name="tool_use", tools=("calculator",))
    with pytest.raises(ConfigError, match=r"^environment.name: set reward_fn"):
        build_graph(dataclasses.replace(cfg, environment=env, reward_fn=""))


QWEN_LIKE = ("{% for m in messages %}{% if m.role == 'tool' %}<|im_start|> user <tool_response> {{ m.content }} "
             "</tool_response> <|im_end|> {% else %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endif %}"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def test_multi_turn_chat_template_observation_tokens_are_the_templates_tool_turn(tmp_path):
    from restage.data.tokenizer import build_word_tokenizer, load_tokenizer
    from restage.runtime.step.episode_feed import observation_ids

    words = ["<|im_start|>", "<|im_end|>", "user", "assistant", "tool", "<tool_response>", "</tool_response>", "x",
             "y", "42", "7"]
    build_word_tokenizer(["[PAD]", "[BOS]", "[EOS]", "[UNK]", *words], tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN_LIKE}))
    tokenizer = load_tokenizer(tmp_path)
    ids = observation_ids(tokenizer, [{"role": "tool", "content": "42"}, {"role": "tool", "content": "7"}])
    want = "<|im_start|> user <tool_response> 42 </tool_response> <|im_end|> " \
           "<|im_start|> user <tool_response> 7 </tool_response> <|im_end|> <|im_start|> assistant"
    assert ids == tokenizer.encode(want, add_special_tokens=False)
    assert observation_ids(tokenizer, "<|im_start|> 7") == tokenizer.encode("<|im_start|> 7", add_special_tokens=False)


def test_multi_turn_arith_tools_pays_for_the_calls_expression():
    from restage.algorithms.arith_env import ArithTools

    def episode(call: str, final: str) -> float:
        env = ArithTools(_context("compute 7 * 4 8 :"))
        assert not env.step(call).done
        return env.step(final).reward

    assert episode("<call> 7 * 4 8 </call>", "3 3 6") == pytest.approx(0.25 + 1.0)  # the whole expression, right answer
    assert episode("<call> 3 </call>", "3 3 6") == pytest.approx(0.25 * 0.25 + 1.0)  # a call that ran, nothing in place
    assert episode("<call> 7 * 4 </call>", "9") == pytest.approx(0.25 * (0.25 + 0.75 * 3 / 4) + 0.0)
