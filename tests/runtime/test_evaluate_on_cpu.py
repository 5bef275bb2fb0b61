"""Evaluation during training, the parts one process can check: cadence, passes, the program, greedy answers."""

from __future__ import annotations

import pytest
import torch

from restage.algorithms.interface import build_graph
from restage.config.load import config_from_dict
from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.runtime.step import evaluation
from restage.runtime.step.evaluation import eval_due, eval_passes, pass_ops, plan_eval
from restage.schedule.execution import Sync
from restage.schedule.ops import SendKey, op_subject


def _cfg(**run):
    return config_from_dict({"experiment": "x", "algorithm": "ppo", "models": {
        "actor": {"path": "p", "trainable": True}, "critic": {"path": "p", "trainable": True}, "ref": {"path": "p"},
        "reward": {"path": "p"}}, "dataset": {"eval_fraction": 0.1}, "run": {"batch_size": 8, **run}})


def test_cadence_is_every_nth_step_and_the_last():
    run = _cfg(steps=7, eval_every=3).run
    assert [done for done in range(1, 8) if eval_due(done, run)] == [3, 6, 7]
    assert not any(eval_due(done, _cfg(steps=7).run) for done in range(1, 8))


def test_passes_cover_every_held_out_prompt_once_and_feed_every_dp_rank():
    assert eval_passes(20, 8, 2) == [tuple(range(8)), tuple(range(8, 16)), tuple(range(16, 20))]
    assert eval_passes(17, 8, 2) == [tuple(range(8)), tuple(range(8, 17))]  # a leftover of 1 joins the pass before
    assert eval_passes(3, 8, 2) == [(0, 1, 2)]
    with pytest.raises(ConfigError, match="holds out 3 prompts, fewer than the 4 data-parallel ranks"):
        eval_passes(3, 8, 4)


def test_the_program_generates_where_the_actor_generates_scores_with_the_reward_model_and_trains_nothing():
    cfg = _cfg(steps=4, eval_every=2)
    graph = build_graph(cfg)
    train, gen = Layout.contiguous(0, Strategy(tp=2)), Layout.contiguous(0, Strategy(dp=2))
    side = Layout.contiguous(1, Strategy())
    layouts = {"actor_gen": gen, "reward_inf": side, "ref_inf": side, "critic_inf": side, "actor_train": train,
               "critic_train": gen}
    plan = plan_eval(graph, layouts, cfg, n_prompts=20, offload_idle=frozenset({"reward"}), execution=Sync())
    assert (plan.generate.name, plan.reward.name) == ("actor_gen", "reward_inf")
    assert [len(p) for p in plan.passes] == [8, 8, 4]
    kinds = [(op.kind, op.key if isinstance(op, SendKey) else op_subject(op)) for op in plan.ops]
    assert kinds == [("realloc", "actor"), ("run", "actor_gen"), ("free", "actor"), ("reload", "reward"),
                     ("transfer", "seqs"), ("transfer", "prompt_mask"), ("run", "reward_inf"), ("offload", "reward")]
    first, middle, last = (pass_ops(plan, i) for i in range(3))
    assert [op.kind for op in first] == ["realloc", "run", "reload", "transfer", "transfer", "run"]
    assert [op.kind for op in middle] == ["run", "transfer", "transfer", "run"]
    assert [op.kind for op in last] == ["run", "free", "transfer", "transfer", "run", "offload"]
    rule = _cfg(steps=4, eval_every=2)
    rule = config_from_dict({**rule.to_dict(), "reward_fn": "sort", "models": {
        k: v for k, v in rule.to_dict()["models"].items() if k != "reward"}})
    plan = plan_eval(build_graph(rule), layouts, rule, n_prompts=20, execution=Sync())
    assert plan.reward is None and [op.kind for op in plan.ops] == ["realloc", "run", "free"]
    assert plan_eval(graph, layouts, _cfg(), n_prompts=20, execution=Sync()) is None


def test_greedy_answers_do_not_depend_on_the_seed_or_the_rng(tmp_path):
    """Two evaluations of the same weights answer alike; the run's RNG stream is left where it was."""
    from restage.data.batch import pack_sequences
    from restage.demo import ensure_tiny_model
    from restage.graph import MFC
    from restage.models.hf_checkpoint import load_stage
    from restage.runtime.step.execute import run_eval_generate

    path = ensure_tiny_model()
    cfg = config_from_dict({"experiment": "x", "algorithm": "ppo", "reward_fn": "sort",
                            "models": {"actor": {"path": str(path)}}, "generation": {"max_new_tokens": 7}})
    layout = Layout.contiguous(0, Strategy())
    module = load_stage(str(path), layout, None, 0, torch.float32, torch.device("cpu"))
    mfc = MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs", "prompt_mask", "logprobs"), 4, 9, 7)
    prompts = pack_sequences([[1, 14, 5, 3, 9, 15], [1, 14, 7, 4, 15], [1, 14, 3, 3, 8, 6, 15]], key="prompts",
                             ids=[0, 1, 2])
    torch.manual_seed(0)
    first = run_eval_generate(module, mfc, prompts, cfg)
    after_first = torch.rand(1)
    torch.manual_seed(0)
    second = run_eval_generate(module, mfc, prompts, cfg)
    assert torch.rand(1) == after_first  # greedy decoding drew no random numbers
    assert torch.equal(first["seqs"], second["seqs"]) and first.seqlens == second.seqlens
    lengths = evaluation.answer_tokens(first, "prompt_mask")
    assert lengths.tolist() == [n - p for n, p in zip(first.seqlens, (6, 5, 7))] and (lengths >= 1).all()
