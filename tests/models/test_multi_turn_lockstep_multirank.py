"""Multi-turn episodes on layouts whose replicas step in lockstep (``rollout/turns.py``, ``TurnEngine.run``):
under expert parallelism (an ep group's replicas exchange tokens in every sparse layer) and on a ZeRO-3 engine
generating in place (every forward gathers parameters over dp), replicas with different prompts and tools of
different speeds give the episodes a one-rank play gives, and every replica of a lockstep group runs the same
number of forwards (a replica waiting on its tools joins its peers' steps). Issue 31: multi-turn on every layout."""

from __future__ import annotations

import shutil

import pytest

from restage.layout import Layout, ProcessGroups, Strategy

pytestmark = pytest.mark.multirank

EP_LAYOUTS = {"dp4ep2": Strategy(dp=4, ep=2), "dp2ep2pp2": Strategy(dp=2, pp=2, ep=2)}


def _prompts(replica: int) -> list[int]:
    """Which of ``multi_turn_cases.PROMPTS`` replica ``replica`` plays: all, one, the last two, all reversed."""
    return [[0, 1, 2], [1], [1, 2], [2, 1, 0]][replica % 4]


def _play(module, cfg, replica: int, counted=None):
    """The replica's episodes (sample ids 10 + prompt index) with a slow first tool call on replica 0's sample 10;
    (sequences, rewards, forwards of ``counted`` (default: the module) this rank ran)."""
    from multi_turn_cases import PROMPTS, Scripted, sequences

    from restage.algorithms.base import CallContext
    from restage.algorithms.interface import get_algorithm
    from restage.data.batch import pack_sequences
    from restage.data.tokenizer import load_tokenizer
    from restage.runtime.step.multi_turn import generate_batch

    tokenizer = load_tokenizer(cfg.dataset.tokenizer)
    chosen = _prompts(replica)
    ids = [[tokenizer.bos_token_id] + tokenizer.encode(PROMPTS[i], add_special_tokens=False) for i in chosen]
    prompts = pack_sequences(ids, key="prompts", ids=[10 + i for i in chosen])
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    Scripted.delays = {10: 0.3} if replica == 0 else {}
    forwards = [0]
    counted = counted if counted is not None else module
    hook = counted.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    result = generate_batch(module, state.graph["actor_gen"], prompts, algo, cfg, state, CallContext(), seed=5)
    hook.remove()
    Scripted.delays = {}
    return sequences(result.batch), result.batch["rewards"].tolist(), forwards[0]


def _run_ep(rank, world_size, path):
    from multi_turn_cases import config

    from restage.models.hf_checkpoint import load_stage
    from restage.models.moe import MoEMLP

    layouts = {"dp4": Layout(tuple(range(world_size)), Strategy(dp=4)),
               **{key: Layout(tuple(range(world_size)), s) for key, s in EP_LAYOUTS.items()}}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    cfg = config(path, path)
    out = {}
    for key, layout in layouts.items():
        module = load_stage(path, layout, groups, rank)
        # Real steps and joins alike run every sparse layer: count the stage's first one.
        sparse = next(block.mlp for block in module.layers.values() if isinstance(block.mlp, MoEMLP))
        out[key] = (module.ctx.dp_rank, module.ctx.ep_rank, _play(module, cfg, module.ctx.dp_rank, sparse))
    return out


def _moe_arith_model(root):
    """A random tiny Mixtral over the calculator task's vocabulary and tokenizer."""
    from restage.data import arith
    from restage.demo import ensure_arith_model
    from restage.models.tiny import build_tiny

    dense = ensure_arith_model(root)  # builds the task's tokenizer too
    path = root / "mixtral-arith"
    build_tiny(path, family="mixtral", seed=3, vocab_size=len(arith.VOCAB), tokenizer=False, hidden_size=64,
               intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64)
    for file in dense.iterdir():
        if "token" in file.name:
            shutil.copy(file, path / file.name)
    return str(path)


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory):
    from restage.runtime.control.spawn import spawn

    return spawn(_run_ep, 4, _moe_arith_model(tmp_path_factory.mktemp("moe")), timeout_seconds=600)


@pytest.mark.parametrize("key", list(EP_LAYOUTS))
def test_multi_turn_episodes_under_expert_parallelism_equal_one_rank(ep_results, key):
    from multi_turn_cases import Scripted  # noqa: F401  (registers the scripted environment here too)

    assert [result["dp4"][0] for result in ep_results] == [0, 1, 2, 3]  # dp4, ep 1: rank r plays replica r alone
    forwards: dict[tuple[int, int], set[int]] = {}
    for rank, result in enumerate(ep_results):
        replica, ep_rank, (episodes, rewards, count) = result[key]
        assert (episodes, rewards) == tuple(ep_results[replica]["dp4"][2][:2]), (key, rank)
        assert rewards == [1.5] * 2 * len(_prompts(replica))  # every episode played its three turns
        forwards.setdefault((replica // EP_LAYOUTS[key].ep, rank % (4 // EP_LAYOUTS[key].dp)), set()).add(count)
        assert ep_rank == replica % EP_LAYOUTS[key].ep
    # The replicas of an ep group (same stage) ran the same forwards, though their episodes differ in number.
    assert all(len(counts) == 1 for counts in forwards.values()), forwards
    counts = [ep_results[0]["dp4"][2][2], ep_results[1]["dp4"][2][2]]  # alone, replicas 0 and 1 differ
    assert counts[0] != counts[1]


def _run_zero3(rank, world_size, path):
    from multi_turn_cases import config

    from restage.config.sections import ModelSpec, OptimConfig
    from restage.models.hf_checkpoint import load_stage
    from restage.runtime.store import zero3_generation
    from restage.runtime.store.zero_engines import build_engine

    layout = Layout(tuple(range(world_size)), Strategy(dp=world_size))
    groups = ProcessGroups(layout.all_groups(), singletons=True, timeout_seconds=120)
    cfg = config(path, path)
    reference = _play(load_stage(path, Layout((rank,), Strategy()), None, rank), cfg, rank)
    spec = ModelSpec(path="-", trainable=True, zero_stage=3, optim=OptimConfig(lr=0.1))
    engine = build_engine(load_stage(path, layout, groups, rank), spec, layout, rank, groups, micro_batches=1,
                          total_optimizer_steps=1)
    with zero3_generation.generation_module(engine.module, layout, groups, "lockstep") as module:
        got = _play(module, cfg, rank)
    return reference, got


@pytest.mark.scale  # about 35 s (a DeepSpeed engine): make test's time bound; ep above runs the same lockstep loop
def test_multi_turn_episodes_on_a_zero3_engine_in_lockstep_equal_one_rank(tmp_path):
    from multi_turn_cases import Scripted  # noqa: F401

    from restage.demo import ensure_arith_model
    from restage.runtime.control.spawn import spawn

    path = str(ensure_arith_model(tmp_path))
    results = spawn(_run_zero3, 2, path, env={"DS_ACCELERATOR": "cpu"}, timeout_seconds=300)
    for reference, got in results:
        assert got[:2] == reference[:2]
    # Alone, replica 0 (three prompts, a slow tool) and replica 1 (one prompt) run different forwards; in lockstep
    # both run the same.
    assert results[0][0][2] != results[1][0][2] and results[0][1][2] == results[1][1][2]
