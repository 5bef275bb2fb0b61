"""Multi-turn rollouts in the engine (``rollout/turns.py``, ``runtime/step/multi_turn.py``): an episode's tokens do
not depend on the slots or on when its tools return; a slot goes to another request while a tool runs; masks,
log-probs, budgets and turn counts are what the docs say (issue 31, items 2 and 4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from multi_turn_cases import STARTED, WAITED, Scripted, config, episodes, sequences

from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage

ONE_RANK = Layout((0,), Strategy())


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    from restage.demo import ensure_arith_model

    root = tmp_path_factory.mktemp("arith")
    path = ensure_arith_model(root)
    return str(path), load_stage(str(path), ONE_RANK, None, 0)


def _with(cfg, **generation):
    return dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, **generation))


def test_multi_turn_episode_tokens_do_not_depend_on_slots_or_tool_timing(arith):
    path, module = arith
    cfg = config(path, path)
    Scripted.delays = {}
    many = episodes(module, cfg)
    Scripted.delays = {10: 0.3, 12: 0.1}
    one = episodes(module, _with(cfg, max_slots=1))
    assert sequences(many.batch) == sequences(one.batch)
    assert torch.allclose(many.batch["logprobs"], one.batch["logprobs"], atol=1e-5)
    assert many.stats["actor_gen/turns"] == 3.0  # the scripted environment asks for three answers
    assert many.stats["actor_gen/observation_tokens"] == 2 * 3  # two observations of three tokens each


def test_multi_turn_masks_logprobs_and_rewards(arith):
    path, module = arith
    Scripted.delays = {}
    result = episodes(module, config(path, path), version=4)
    batch = result.batch
    not_policy = batch["prompt_mask"].bool()
    assert (batch["logprobs"][not_policy] == 0).all() and (batch["logprobs"][~not_policy] < 0).all()
    assert batch["rewards"].tolist() == [1.5] * 6  # three steps of 0.5, summed
    observation = torch.tensor([22, 11, 23])  # <result> 7 </result> in the arith vocabulary
    for ids, policy in sequences(batch):
        marks = [i for i in range(len(ids) - 2) if ids[i:i + 3] == observation.tolist()]
        assert len(marks) == 2 and all(policy[i:i + 3] == [0, 0, 0] for i in marks)
        assert sum(policy) == len(ids) - 8 - 6  # everything else after the prompt of 8 was written by the policy


def test_multi_turn_slot_goes_to_another_request_while_a_tool_runs(arith):
    path, module = arith
    cfg = _with(config(path, path), max_slots=1)
    STARTED.clear()
    WAITED.clear()
    Scripted.delays, Scripted.waits = {}, {10: 12}
    result = episodes(module, cfg)
    # One slot: sample 10's first tool call returns only once sample 12's first turn has run and reached its step,
    # which needs the slot sample 10's episodes held before their tools began.
    assert WAITED == {10: True}
    assert result.stats["actor_gen/turns"] == 3.0
    Scripted.waits = {}


def test_multi_turn_episode_over_its_budget_is_cut_with_the_documented_reward(arith):
    path, module = arith
    Scripted.delays = {}
    cfg = config(path, path, max_episode_tokens=14, over_budget_reward=-1.0)
    result = episodes(module, cfg)
    assert all(len(ids) - 8 <= 14 for ids, _ in sequences(result.batch))
    cut = result.stats["actor_gen/cut_episodes"]
    assert cut > 0 and result.batch["rewards"].tolist().count(-1.0) == round(cut * 6)


def test_multi_turn_episodes_run_on_a_lora_actor(arith):
    from restage.models.arch import LoraConfig

    path, module = arith
    Scripted.delays = {}
    cfg = config(path, path)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q", "k", "v", "o"))
    adapted = load_stage(path, ONE_RANK, None, 0, lora=lora)
    assert sequences(episodes(adapted, cfg).batch) == sequences(episodes(module, cfg).batch)  # fresh adapters: B = 0
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if ".lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    changed = episodes(adapted, cfg)
    assert sequences(changed.batch) != sequences(episodes(module, cfg).batch)  # the adapters are in every turn
    assert changed.stats["actor_gen/turns"] == 3.0
