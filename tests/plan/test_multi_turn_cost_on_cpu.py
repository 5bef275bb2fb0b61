"""The estimator's cost of multi-turn generation (``algorithms/episode_sizes.py``, ``estimator._generate``): turns,
observation tokens and the tool latency figure (issue 31, item 2)."""

import pytest

from restage.algorithms.interface import build_graph
from restage.cluster import load_cluster
from restage.config.load import config_from_dict
from restage.graph import MFC, Episodes, MFCOptions
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.plan.estimator import Estimator
from restage.plan.roles import ModelRole


def _cfg(**environment):
    return config_from_dict({"experiment": "t", "algorithm": "grpo", "reward_fn": "sort",
                             "models": {"actor": {"path": "x", "trainable": True}},
                             "algo": {"group_size": 4, "kl_coef": 0.0}, "environment": environment,
                             "generation": {"max_new_tokens": 128}, "dataset": {"max_prompt_tokens": 256}})


def test_multi_turn_graph_sizes_episodes():
    graph = build_graph(_cfg(name="tool_use", tools=["calculator"], max_turns=3, max_episode_tokens=512,
                             tool_latency_seconds=0.25))
    gen, train = graph["actor_gen"], graph["actor_train"]
    assert (gen.gen_tokens, gen.options.episodes) == (3 * 128, Episodes(3, 512 - 3 * 128, 0.25))
    assert gen.to_json()["options"] == {"group_size": 4, "turns": 3, "observation_tokens": 512 - 3 * 128,
                                        "tool_seconds": 0.25}  # the schedule file's keys, as before they were typed
    assert train.gen_tokens == 512 and train.prompt_tokens == 256  # training reads whole episodes
    single = build_graph(_cfg())["actor_gen"]
    assert single.gen_tokens == 128 and single.options.episodes is None


def _gen(turns: int, observed: int, tool: float) -> MFC:
    options = MFCOptions(group_size=4, episodes=Episodes(turns, observed, tool))
    return MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs",), 256, 256, 384, options=options)


def test_multi_turn_generation_costs_turn_prefills_and_tool_latency():
    est = Estimator(load_cluster("h100-80gb"))
    role, layout = ModelRole("actor", preset("llama-7b")), Layout.contiguous(0, Strategy())
    one = est.estimate(_gen(1, 0, 0.0), role, layout)
    three = est.estimate(_gen(3, 128, 0.0), role, layout)
    slow = est.estimate(_gen(3, 128, 0.5), role, layout)
    b = dict(three.breakdown)
    assert "turn_prefill_seconds" in b and b["turn_prefill_seconds"] > 0 and "turn_prefill_seconds" not in dict(
        one.breakdown)
    assert dict(slow.breakdown)["tool_seconds"] == pytest.approx(2 * 0.5)  # two calls on an episode's path
    assert slow.seconds == pytest.approx(three.seconds + 1.0)
    assert three.seconds > one.seconds + b["turn_prefill_seconds"] * 0.99  # longer contexts decode slower too
    assert three.transient_bytes > one.transient_bytes  # each slot holds the observation tokens as well
