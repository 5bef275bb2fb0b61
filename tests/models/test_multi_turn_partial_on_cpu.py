"""Partial rollouts of multi-turn episodes (``runtime/step/partial_episodes.py``): a generate call finishes one step's
episodes and begins the next's, which the next call continues; under unchanged weights every episode equals its
uninterrupted play token for token, and each token records the version of the call that wrote it (issue 31,
"works with ... partial rollouts")."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from multi_turn_cases import PROMPTS, STARTED, WAITED, Scripted, config, sequences

from restage.algorithms.base import CallContext
from restage.algorithms.interface import get_algorithm
from restage.data.batch import pack_sequences
from restage.data.tokenizer import load_tokenizer
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.rollout.turns import NextTurn
from restage.runtime.step.episode_feed import EpisodeFeed
from restage.runtime.step.multi_turn import generate_batch, start_episodes
from restage.runtime.step.partial_episodes import EpisodesInFlight, run_partial_episodes

ONE_RANK = Layout((0,), Strategy())
TURNS = 3  # multi_turn_cases.config's max_turns


@pytest.fixture(scope="module")
def arith(tmp_path_factory):
    from restage.demo import ensure_arith_model

    path = str(ensure_arith_model(tmp_path_factory.mktemp("arith")))
    cfg = config(path, path)
    cfg = dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, execution="async", partial_rollouts=True,
                                                            staleness=2),
                              rewards=dataclasses.replace(cfg.rewards, workers=16))
    tokenizer = load_tokenizer(path)
    algo = get_algorithm(cfg.algorithm)
    return load_stage(path, ONE_RANK, None, 0), cfg, tokenizer, algo, algo.init_state(cfg, tokenizer)


def _batch(tokenizer, first_id: int):
    ids = [[tokenizer.bos_token_id] + tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return pack_sequences(ids, key="prompts", ids=[first_id + i for i in range(len(PROMPTS))])


def _whole(arith, batch, seed):
    module, cfg, _, algo, state = arith
    return generate_batch(module, state.graph["actor_gen"], batch, algo, cfg, state, CallContext(), seed,
                          version=0).batch


def _partial(arith, now, begun, later, seeds, version):
    module, cfg, _, algo, state = arith
    return run_partial_episodes(module, state.graph["actor_gen"], now, begun, later, algo, cfg, state, CallContext(),
                                seeds, version)


def test_multi_turn_partial_rollouts_continue_episodes_across_calls_to_their_uninterrupted_tokens(arith):
    _, _, tokenizer, _, _ = arith
    a, b, c = (_batch(tokenizer, first) for first in (10, 20, 30))
    Scripted.delays, Scripted.waits = {}, {}
    reference_b, reference_c = _whole(arith, b, 6), _whole(arith, c, 7)
    STARTED.clear()
    WAITED.clear()
    # Sample 10's first tool step waits until sample 21's has begun, so call 1 cannot end before batch b has
    # begun; sample 21's waits for the test (sample 99), so it is still running when call 1 ends.
    Scripted.waits = {10: 21, 21: 99}
    first, oldest, begun = _partial(arith, a, None, b, (5, 6), version=1)
    assert oldest == 1 and begun is not None and first.stats["actor_gen/cut_samples"] > 0
    sample_21 = {e * TURNS for e in (2, 3)}  # rows of the first turns of sample 21's two episodes (group 2)
    assert sample_21 <= set(begun.running.values())  # their tool steps carried over, still running
    assert all(not future.done() for future, row in begun.running.items() if row in sample_21)
    STARTED.setdefault(99, threading.Event()).set()
    second, oldest, begun_c = _partial(arith, b, begun, c, (6, 7), version=2)
    third, _, none = _partial(arith, c, begun_c, None, (7, 8), version=3)
    assert WAITED == {10: True, 21: True} and none is None
    assert sequences(second.batch) == sequences(reference_b) and sequences(third.batch) == sequences(reference_c)
    assert second.batch["rewards"].tolist() == reference_b["rewards"].tolist() == [1.5] * 6
    assert torch.allclose(second.batch["logprobs"], reference_b["logprobs"], atol=1e-5)
    versions = second.batch["versions"]
    policy = ~second.batch["prompt_mask"].bool()
    assert (versions[~policy] == -1).all() and set(versions[policy].tolist()) == {1, 2} and oldest == 1
    assert set(third.batch["versions"][~third.batch["prompt_mask"].bool()].tolist()) <= {2, 3}
    Scripted.waits = {}


def test_multi_turn_partial_rollout_continues_a_turn_cut_mid_answer(arith):
    """A turn cut after some of its tokens (an open turn, as the engine leaves it) decodes on from its position
    with its own noise: the episode equals the uninterrupted one, and the cut tokens keep their old version."""
    module, cfg, tokenizer, _, state = arith
    b = _batch(tokenizer, 20)
    Scripted.delays, Scripted.waits = {}, {}
    reference = _whole(arith, b, 6)
    ids, policy = sequences(reference)[0]
    prompt_len = policy.index(1)
    first_answer = policy.index(0, prompt_len) - prompt_len  # episode 0's first turn: its tokens up to the observation
    cut = first_answer - 1  # cut before the turn's last token
    assert cut >= 1
    answer = ids[prompt_len:prompt_len + cut]
    logprobs = reference["logprobs"][prompt_len:prompt_len + cut].tolist()
    episodes = start_episodes(b, cfg, state, CallContext(), group=2)
    feed = EpisodeFeed(episodes, cfg, tokenizer, None)  # only for the first turns' caps
    turns = feed.first_turns(0, len(episodes))
    turns[0] = NextTurn(0, turns[0].context, turns[0].max_new, tuple(answer), tuple(logprobs))
    begun = EpisodesInFlight(episodes, turns, {0: (4,) * cut}, {}, None)
    result, oldest, _ = _partial(arith, b, begun, None, (6, 7), version=5)
    assert sequences(result.batch) == sequences(reference)
    assert torch.allclose(result.batch["logprobs"], reference["logprobs"], atol=1e-5)
    versions = result.batch["versions"][:len(ids)].tolist()
    assert versions[prompt_len:prompt_len + cut] == [4] * cut and oldest == 4
    assert set(versions[prompt_len + cut:]) == {-1, 5} and set(result.batch["versions"][len(ids):].tolist()) == {-1, 5}


def test_multi_turn_partial_checkpoint_drops_live_episodes_and_restarts_them(arith):
    """Environments cannot be saved: the rollout buffer's checkpoint keeps begun answers but not begun episodes, and
    the call that finishes such a batch after a resume (nothing begun) plays it from ``reset`` with its step's seeds:
    under unchanged weights, the uninterrupted episodes (docs/algorithms.md, Modes)."""
    from restage.runtime.dataplane.rollout_buffer import Answer, RolloutBuffer

    _, _, tokenizer, _, _ = arith
    b = _batch(tokenizer, 20)
    Scripted.delays, Scripted.waits = {}, {}
    buffer = RolloutBuffer()
    buffer.keep_in_flight("actor_gen", 3, EpisodesInFlight())
    buffer.keep_in_flight("other_gen", 3, (Answer((5, 6), (-0.5, -0.25), (2, 2)),))
    restored = RolloutBuffer()
    restored.load_state_dict(buffer.state_dict())
    assert restored.resume_in_flight("actor_gen", 3) is None
    assert restored.resume_in_flight("other_gen", 3) == (Answer((5, 6), (-0.5, -0.25), (2, 2)),)
    restarted, oldest, _ = _partial(arith, b, None, None, (6, 7), version=4)
    assert sequences(restarted.batch) == sequences(_whole(arith, b, 6)) and oldest == 4
