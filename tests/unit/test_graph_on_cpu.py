import pytest

from restage.algorithms.interface import build_graph
from restage.config.load import config_from_dict
from restage.config.schema import ConfigError
from restage.graph import MFC, DataflowGraph


def cfg(algorithm, models, **extra):
    return config_from_dict({"experiment": "x", "algorithm": algorithm,
                             "models": {m: {"path": "p", "trainable": m in ("actor", "critic")} for m in models},
                             "run": {"batch_size": 8}, **extra})


def test_ppo_graph_edges_follow_keys():
    graph = build_graph(cfg("ppo", ["actor", "critic", "ref", "reward"]))
    assert [m.name for m in graph] == ["actor_gen", "reward_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"]
    assert graph.source_keys() == ("prompts",)
    assert {p.name for p in graph.parents("actor_train")} == {"actor_gen", "reward_inf", "ref_inf", "critic_inf"}
    assert {p.name for p in graph.parents("ref_inf")} == {"actor_gen"}
    assert graph.trained_models() == ("actor", "critic")


def test_function_reward_drops_the_reward_model_and_grpo_scales_by_group():
    graph = build_graph(cfg("grpo", ["actor", "ref"], reward_fn="restage.data.tasks:reward", algo={"group_size": 3}))
    assert [m.name for m in graph] == ["actor_gen", "ref_inf", "actor_train"]
    assert graph["actor_gen"].n_seqs == 24
    assert "rewards" in graph["actor_gen"].outputs


@pytest.mark.parametrize("algorithm,models", [("sft", ["actor"]), ("rm", ["reward"]), ("dpo", ["actor", "ref"]),
                                              ("remax", ["actor", "ref", "reward"]), ("raft", ["actor", "reward"])])
def test_every_algorithm_builds_a_graph(algorithm, models):
    graph = build_graph(cfg(algorithm, models))
    assert set(graph.models()) == set(models)
    assert DataflowGraph.from_json(graph.to_json()) == graph


def test_missing_model_and_cycles_are_refused():
    with pytest.raises(ConfigError, match=r"needs models \['critic', 'reward'\]"):
        build_graph(cfg("ppo", ["actor", "ref"]))
    a = MFC("a", "inference", "m", ("y",), ("x",), 1, 1, 1)
    b = MFC("b", "inference", "m", ("x",), ("y",), 1, 1, 1)
    with pytest.raises(ConfigError, match="cycle"):
        DataflowGraph((a, b))
