"""Async mode's program (schedule/async_program.py), its ops' JSON, and the rollout buffer's checkpoint state."""

import pytest
import torch

from restage.algorithms.interface import build_graph
from restage.config.load import config_from_dict
from restage.data.batch import pack_sequences
from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.runtime.dataplane.rollout_buffer import Buffered, RolloutBuffer
from restage.runtime.step.evaluation import plan_eval
from restage.schedule.async_program import build_async_program, lookahead
from restage.schedule.execution import Async, Sync
from restage.schedule.ops import Generate, Push, SendKey, TakeBuffered, op_from_json, op_subject, op_to_json

GEN = Layout.contiguous(1, Strategy(dp=1))
TRAIN = Layout.contiguous(0, Strategy(dp=1))


def config(algorithm="grpo", **plan):
    models = {m: {"path": "p", "trainable": m in ("actor", "critic")} for m in ("actor", "critic", "ref")}
    if algorithm == "grpo":
        del models["critic"]
    return config_from_dict({"experiment": "x", "algorithm": algorithm, "reward_fn": "sort", "models": models,
                             "plan": {"execution": "async", **plan}})


def test_generation_runs_ahead_of_training_on_its_own_ranks():
    graph = build_graph(config())
    layouts = {m.name: (GEN if m.name == "actor_gen" else TRAIN) for m in graph}
    ops = build_async_program(graph, layouts, staleness=1, push_every=1)
    walk = [(op.kind, op_subject(op)) for op in ops]
    # push, warm-up, take, every transfer out of the generator, the next batch's generation, then the consumers
    assert walk[:3] == [("push", "actor"), ("generate", "actor_gen"), ("take", "actor_gen")]
    gen_at = walk.index(("generate", "actor_gen"), 2)
    assert {op.producer for op in ops[3:gen_at]} == {"actor_gen"} and all(op.kind == "transfer" for op in ops[3:gen_at])
    assert [o.mfc for o in ops[gen_at:] if o.kind == "run"] == ["ref_inf", "actor_prox", "actor_train"]
    assert all(op.kind != "transfer" or op.producer != "actor_gen" for op in ops[gen_at:])
    warmup, steady = ops[1], ops[gen_at]
    assert isinstance(warmup, Generate) and (warmup.start, warmup.stop) == (0, 1)
    assert isinstance(steady, Generate) and (steady.start, steady.stop) == (1, 2)
    push = ops[0]
    assert isinstance(push, Push) and (push.src, push.dst, push.every, push.ranks) == (TRAIN, GEN, 1, (0, 1))
    assert not [op for op in ops if op.kind in ("realloc", "free") and op_subject(op) == "actor"]  # the copy stays


@pytest.mark.parametrize("staleness, push_every, ahead", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (3, 2, 2)])
def test_lookahead_and_push_interval_keep_the_bound(staleness, push_every, ahead):
    assert lookahead(staleness, push_every) == ahead
    # the batch of step t is generated at step t - ahead by the weights of the last push (a multiple of push_every)
    for t in range(ahead, 40):
        made_at = t - ahead
        version = made_at - made_at % push_every
        assert 0 <= t - version <= staleness
    assert max(t - ((t - ahead) - (t - ahead) % push_every) for t in range(ahead, 40)) == staleness


def test_ppo_generation_sharing_the_trained_actors_ranks_is_refused():
    graph = build_graph(config("ppo"))
    layouts = {m.name: TRAIN for m in graph}
    with pytest.raises(ConfigError, match="actor_gen runs on ranks \\[0\\], which actor_prox also uses"):
        build_async_program(graph, layouts, staleness=1, push_every=1)


def test_push_every_beyond_the_bound_is_refused():
    with pytest.raises(ConfigError, match="plan.push_every: 3 must be between 1 and plan.staleness=2"):
        config(staleness=2, push_every=3)


@pytest.mark.parametrize("scorer", ["rule", "model"])
def test_async_evaluation_answers_in_the_training_layout_and_leaves_the_generation_copy_alone(scorer):
    """Held-out evaluation in async mode (once refused) passes the config. The actor answers in its training layout,
    which holds the step's version; no realloc, free or push touches its generation copy, and no generate or take
    touches the rollout buffer. The same layouts in sync mode answer in the generation layout, by a copy."""
    raw = config("ppo").to_dict()
    raw |= {"dataset": {"eval_fraction": 0.1}, "run": {"eval_every": 2, "batch_size": 8}}
    if scorer == "model":
        raw |= {"reward_fn": "", "models": {**raw["models"], "reward": {"path": "p"}}}
    cfg = config_from_dict(raw)
    assert (cfg.run.eval_every, cfg.plan.execution) == (2, "async")
    graph = build_graph(cfg)
    train, gen, side = (Layout.contiguous(0, Strategy(dp=2)), Layout.contiguous(2, Strategy(dp=1)),
                        Layout.contiguous(1, Strategy(dp=1)))
    layouts = {m.name: gen if m.name == "actor_gen" else side if m.name == "reward_inf" else train for m in graph}
    build_async_program(graph, layouts, staleness=1, push_every=1)  # layouts async mode runs
    plan = plan_eval(graph, layouts, cfg, n_prompts=20, execution=Async(1, 1))
    assert plan.layouts == {**layouts, "actor_gen": train}
    walk = [(op.kind, op.key if isinstance(op, SendKey) else op_subject(op), op.ranks) for op in plan.ops]
    if scorer == "rule":
        assert plan.reward is None and walk == [("run", "actor_gen", (0, 1))]
    else:
        assert plan.reward is not None and plan.reward.name == "reward_inf"
        assert walk == [("run", "actor_gen", (0, 1)), ("transfer", "seqs", (0, 1)),
                        ("transfer", "prompt_mask", (0, 1)), ("run", "reward_inf", (1,))]
    assert [len(p) for p in plan.passes] == [8, 8, 4]
    sync = plan_eval(graph, layouts, cfg, n_prompts=20, execution=Sync())
    assert sync is not None and sync.layouts == layouts
    assert [(op.kind, op_subject(op)) for op in sync.ops[:2]] == [("realloc", "actor"), ("run", "actor_gen")]


def test_new_ops_round_trip_through_json():
    for op in (Push((0, 1), "actor", TRAIN, GEN, 2), Generate((1,), "actor_gen", "actor", GEN, 1, 2),
               TakeBuffered((1,), "actor_gen", GEN)):
        assert op_from_json(op_to_json(op)) == op


def test_rollout_buffer_state_round_trips():
    batch = pack_sequences([[1, 5, 6, 2], [1, 7, 2]], group_size=2, prompt_lens=[1, 1], ids=(4,))
    batch = batch.with_keys(tokens={"logprobs": torch.tensor([0.0, -0.5, -0.25, -1.0, 0.0, -2.0, -0.125])})
    buffer = RolloutBuffer()
    buffer.put("actor_gen", 3, Buffered(batch, 2))
    buffer.put("actor_gen", 4, Buffered(batch.with_keys(seqs={"rewards": torch.tensor([1.0, 0.0])}), 3))
    again = RolloutBuffer()
    again.load_state_dict(buffer.state_dict())
    assert again.occupancy("actor_gen") == 2
    first, second = again.take("actor_gen", 3), again.take("actor_gen", 4)
    assert (first.version, second.version) == (2, 3) and first.batch.ids == (4,) and first.batch.seqlens == (4, 3)
    assert torch.equal(first.batch["logprobs"], batch["logprobs"]) and torch.equal(second.batch["rewards"],
                                                                                    torch.tensor([1.0, 0.0]))
    with pytest.raises(RuntimeError, match="holds no batch for step 4"):
        again.take("actor_gen", 3)
