from dataclasses import replace

import pytest

from restage.algorithms.interface import build_graph
from restage.config.load import config_from_dict
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, MFCOptions, RefEMA
from restage.layout import Layout, Strategy
from restage.models.presets import preset
from restage.schedule.ops import op_subject
from restage.schedule.program import build_program, check_ema_architectures, model_homes


def ppo_graph(**algo):
    cfg = config_from_dict({"experiment": "x", "algorithm": "ppo", "reward_fn": "restage.data.tasks:reward", "algo": algo,
                            "models": {m: {"path": "p", "trainable": m in ("actor", "critic")}
                                       for m in ("actor", "critic", "ref")}})
    return build_graph(cfg)


def test_actor_generates_elsewhere_and_its_copy_is_freed_after_use():
    graph = ppo_graph()
    train = Layout.contiguous(0, Strategy(dp=2, tp=2))
    gen = Layout.contiguous(0, Strategy(dp=4))
    side = Layout.contiguous(2, Strategy(dp=2))
    layouts = {"actor_gen": gen, "ref_inf": side, "critic_inf": side, "actor_train": train,
               "critic_train": Layout.contiguous(0, Strategy(dp=2))}
    assert model_homes(graph, layouts)["actor"] == train
    ops = build_program(graph, layouts, offload_idle=frozenset({"ref"}))
    kinds = [(op.kind, op_subject(op)) for op in ops]
    assert kinds[:3] == [("realloc", "actor"), ("run", "actor_gen"), ("free", "actor")]
    assert ("reload", "ref") in kinds and kinds.index(("reload", "ref")) < kinds.index(("run", "ref_inf"))
    assert kinds.index(("offload", "ref")) == kinds.index(("run", "ref_inf")) + 1
    # critic_inf runs on the critic's non-home layout: a copy, freed after use (the critic trains after).
    assert kinds.count(("realloc", "critic")) == 1 and kinds.count(("free", "critic")) == 1
    transfers = [(op.key, op.producer, op.mfc) for op in ops if op.kind == "transfer"]
    assert ("seqs", "actor_gen", "actor_train") in transfers and ("values", "critic_inf", "critic_train") in transfers
    assert all(op.ranks == tuple(sorted(set(op.src.mesh) | set(op.dst.mesh))) for op in ops if op.kind == "transfer")


def test_colocated_plan_needs_no_reallocation():
    graph = ppo_graph()
    everywhere = Layout.contiguous(0, Strategy(dp=2))
    ops = build_program(graph, {m.name: everywhere for m in graph})
    assert [op.kind for op in ops if op.kind in ("realloc", "free")] == []
    assert [op.mfc for op in ops if op.kind == "run"] == [m.name for m in graph]


# The actor's train layout, the reference's home, and a third layout for copies.
TRAIN, REF_HOME, OTHER = (Layout.contiguous(0, Strategy(dp=2, tp=2)), Layout.contiguous(2, Strategy(dp=2)),
                          Layout.contiguous(0, Strategy(dp=4)))


def ema_graph(*after: MFC) -> DataflowGraph:
    """Generate, two reference inferences, an actor train step with a reference EMA, then ``after``."""
    seq = ("seqs",)
    ema = MFCOptions(ref_ema=RefEMA(0.1, "ref"))
    return DataflowGraph((MFC("gen", "generate", "actor", ("prompts",), seq, 8, 4, 4, 1),
                          MFC("ref_a", "inference", "ref", seq, ("a",), 8, 4, 4, 1),
                          MFC("ref_b", "inference", "ref", seq, ("b",), 8, 4, 4, 1),
                          MFC("train", "train_step", "actor", seq + ("a", "b"), (), 8, 4, 4, 1, options=ema), *after))


def test_reference_ema_mixes_after_the_actor_step_and_frees_stale_reference_copies():
    graph = ema_graph()
    ops = build_program(graph, {"gen": TRAIN, "ref_a": REF_HOME, "ref_b": OTHER, "train": TRAIN})
    kinds = [(op.kind, op_subject(op)) for op in ops]
    assert kinds.index(("ema", "train")) == kinds.index(("run", "train")) + 1
    (op,) = [op for op in ops if op.kind == "ema"]
    assert (op.model, op.src, op.dst, op.ranks) == ("ref", TRAIN, REF_HOME, (0, 1, 2, 3))
    # The EMA makes the reference's copy in ref_b's layout stale: it is freed after ref_b, remade next iteration.
    assert [o.kind for o in ops if o.kind not in ("run", "transfer") and o.model == "ref"] == ["realloc", "free", "ema"]
    without = DataflowGraph(tuple(replace(m, options=MFCOptions()) for m in graph))
    assert [o.kind for o in build_program(without, {"gen": TRAIN, "ref_a": REF_HOME, "ref_b": OTHER, "train": TRAIN})
            if o.kind not in ("run", "transfer") and o.model == "ref"] == ["realloc"]  # a frozen reference keeps its copy


def test_reference_ema_needs_the_actors_architecture():
    graph = ppo_graph(ref_ema_eta=0.1)
    assert next(m for m in graph if m.name == "actor_train").options == MFCOptions(ref_ema=RefEMA(0.1, "ref"))
    tiny = preset("llama-tiny")
    deeper = replace(tiny, num_layers=tiny.num_layers + 1)
    check_ema_architectures(graph, {"actor": tiny, "ref": tiny, "critic": deeper})  # the critic is not mixed
    with pytest.raises(ConfigError, match=r"^algo.ref_ema_eta: models.ref must have the architecture of models.actor"):
        check_ema_architectures(graph, {"actor": tiny, "ref": deeper, "critic": tiny})


def test_a_copy_made_before_a_model_changes_is_made_again_for_a_later_mfc():
    graph = ema_graph(MFC("gen_after", "generate", "actor", ("prompts",), ("seqs2",), 8, 4, 4, 1),
                      MFC("ref_after", "inference", "ref", ("seqs2",), ("c",), 8, 4, 4, 1))
    layouts = {"gen": OTHER, "ref_a": REF_HOME, "ref_b": OTHER, "train": TRAIN, "gen_after": OTHER, "ref_after": OTHER}
    walk = [(o.kind, op_subject(o)) for o in build_program(graph, layouts) if o.kind != "transfer"]
    # The actor's and the reference's copies in OTHER made before the step (and its EMA) hold old
    # weights: the MFCs after it get fresh copies, each freed after its last use.
    assert walk == [
        ("realloc", "actor"), ("run", "gen"), ("run", "ref_a"), ("realloc", "ref"), ("run", "ref_b"),
        ("run", "train"), ("ema", "train"), ("realloc", "actor"), ("run", "gen_after"), ("free", "actor"),
        ("realloc", "ref"), ("run", "ref_after"), ("free", "ref")], walk
