import pytest

from restage.algorithms.interface import build_graph
from restage.config.load import config_from_dict
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, Episodes, MFCOptions, RefEMA


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


@pytest.mark.parametrize("options", [
    {}, {"group_size": 1}, {"group_size": 4, "dynamic_sampling_rounds": 3},
    {"group_size": 4, "turns": 3, "observation_tokens": 128, "tool_seconds": 0.25},
    {"ref_ema_eta": 0.1, "ref_ema_model": "ref"},
])
def test_mfc_options_read_and_write_the_schedule_files_keys_unchanged(options):
    """A schedule written before the options were typed reads back to the same JSON, key by key and in order."""
    data = MFC("g", "generate", "actor", ("prompts",), ("seqs",), 8, 4, 4).to_json() | {"options": options}
    mfc = MFC.from_json(data)
    assert mfc.to_json() == data and list(mfc.to_json()["options"]) == list(options)


def test_mfc_options_are_typed_and_unknown_keys_refused():
    mfc = MFC.from_json(MFC("g", "generate", "actor", ("prompts",), ("seqs",), 8, 4, 4).to_json()
                        | {"options": {"group_size": 4, "turns": 2, "observation_tokens": 7, "tool_seconds": 0.5}})
    assert mfc.options == MFCOptions(group_size=4, episodes=Episodes(2, 7, 0.5)) and mfc.options.group == 4
    assert MFCOptions().group == 1 and MFCOptions(ref_ema=RefEMA(0.1)).to_json() == {"ref_ema_eta": 0.1,
                                                                                     "ref_ema_model": "ref"}
    with pytest.raises(ConfigError, match="^MFC g: unknown options group; known: "):
        MFC.from_json(mfc.to_json() | {"options": {"group": 4}})
