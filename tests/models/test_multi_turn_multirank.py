"""Multi-turn episodes on 4 real gloo ranks: the same episodes (three turns, observations between) give every rank of
every replica the same tokens, masks and rewards under dp4, tp2 x pp2, dp2 x tp2 and dp2 x pp2 as one rank, and
async mode's batch (``versions`` given) the same tokens as sync mode's (issue 31, must-show); and partial rollouts
(one call begins a batch's episodes, the next finishes them) the same under tp2 x pp2 and dp2 x tp2."""

from __future__ import annotations

import dataclasses

import pytest

from restage.layout import Strategy

pytestmark = pytest.mark.multirank

LAYOUTS = {"dp4": Strategy(dp=4), "tp2pp2": Strategy(tp=2, pp=2), "dp2tp2": Strategy(dp=2, tp=2),
           "dp2pp2": Strategy(dp=2, pp=2)}


def _run(rank, world_size, path):
    from multi_turn_cases import config, episodes, sequences

    from restage.layout import Layout, ProcessGroups
    from restage.models.hf_checkpoint import load_stage

    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    cfg = config(path, path)
    cfg = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, max_slots=3))
    out = {}
    for key, layout in layouts.items():
        module = load_stage(path, layout, groups, rank)
        result = episodes(module, cfg)
        out[key] = (sequences(result.batch), result.batch["rewards"].tolist())
        if key in ("tp2pp2", "dp2tp2"):
            out[f"{key}-partial"] = _partial(module, cfg)
        if key == "dp4":
            async_cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, execution="async"))
            batch = episodes(module, async_cfg, version=7).batch
            out["async"] = (sequences(batch), batch["rewards"].tolist())
            out["versions"] = sorted(set(batch["versions"].tolist()))
    return out


def _partial(module, cfg):
    """Call 1 finishes a batch seeded 9 and begins ``episodes``'s (seed 5); call 2 finishes it."""
    from multi_turn_cases import prompts_batch, sequences

    from restage.algorithms.base import CallContext
    from restage.algorithms.interface import get_algorithm
    from restage.data.tokenizer import load_tokenizer
    from restage.runtime.step.partial_episodes import run_partial_episodes

    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, execution="async", partial_rollouts=True,
                                                            staleness=2))
    tokenizer = load_tokenizer(cfg.dataset.tokenizer)
    algo = get_algorithm(cfg.algorithm)
    state = algo.init_state(cfg, tokenizer)
    prompts, mfc = prompts_batch(tokenizer), state.graph["actor_gen"]
    _, _, begun = run_partial_episodes(module, mfc, prompts, None, prompts, algo, cfg, state, CallContext(), (9, 5), 1)
    result, _, _ = run_partial_episodes(module, mfc, prompts, begun, None, algo, cfg, state, CallContext(), (5, 6), 2)
    return sequences(result.batch), result.batch["rewards"].tolist()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from restage.demo import ensure_arith_model
    from restage.runtime.control.spawn import spawn

    path = str(ensure_arith_model(tmp_path_factory.mktemp("arith")))
    return spawn(_run, 4, path, timeout_seconds=600)


def test_multi_turn_episodes_equal_one_rank_under_dp_tp_pp_and_async(results):
    from multi_turn_cases import Scripted  # noqa: F401  (registers the scripted environment here too)

    reference = results[0]["dp4"]  # each rank its own replica: the one-rank episodes
    assert all(r["dp4"] == reference for r in results)
    assert sum(sum(policy) for _, policy in reference[0]) > 0 and reference[1] == [1.5] * 6
    for key in ("tp2pp2", "dp2tp2", "dp2pp2", "async", "tp2pp2-partial", "dp2tp2-partial"):
        for rank, result in enumerate(results):
            assert result[key] == reference, (key, rank)
    assert results[0]["versions"] == [-1, 7]
