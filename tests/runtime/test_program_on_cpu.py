from restage.config import config_from_dict
from restage.graph import build_graph
from restage.layout import Layout, Strategy
from restage.runtime.program import build_program, model_homes


def ppo_graph():
    cfg = config_from_dict({"experiment": "x", "algorithm": "ppo", "reward_fn": "restage.data.tasks:reward",
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
    kinds = [(op.kind, op.mfc or op.model) for op in ops]
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
