"""Function rewards score behind the rank's next ops: the worker's real op loop (``Worker.run_step``) over a
generate MFC whose reward takes S seconds and a reference inference that takes S seconds on the same rank
ends in about max(S, S), not S + S, with the same rewards as the blocking path and the same errors."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest
import torch

from restage.algorithms import rewards, verifiers
from restage.algorithms.base import CallContext, RewardScoring
from restage.algorithms.interface import get_algorithm
from restage.algorithms.scoring import RewardPool
from restage.config.load import config_from_dict
from restage.data.batch import pack_sequences
from restage.errors import RewardError
from restage.layout import Layout, Strategy
from restage.runtime.step.worker import Worker
from restage.schedule.ops import Run, SendKey

S = 1.0  # seconds the reward takes per batch, and the reference inference takes
HERE = Layout.contiguous(0, Strategy())
OPS = [Run((0,), "actor_gen", "actor", HERE),
       SendKey((0,), "ref_inf", "seqs", "actor_gen", HERE, HERE),
       Run((0,), "ref_inf", "ref", HERE),
       SendKey((0,), "actor_train", "seqs", "actor_gen", HERE, HERE),
       SendKey((0,), "actor_train", "rewards", "actor_gen", HERE, HERE),
       Run((0,), "actor_train", "actor", HERE)]


class Letters:
    """A tokenizer of one letter per id (1 -> a), enough for decode."""

    eos_token_id = 0

    def batch_decode(self, seqs, skip_special_tokens=True):
        return ["".join(chr(96 + t) for t in s) for s in seqs]


def slow_batched(prompts, answers, **fields):
    time.sleep(S)
    return [float(len(a) + fields["bonus"][i]) + (math.nan if a == "nan" else 0.0) for i, a in enumerate(answers)]


@verifiers.sample_reward
def slow_sample(prompt, completion, /, **fields):
    time.sleep(S)
    if completion == "boom":
        raise ValueError("cannot parse")
    return float(len(completion) + fields["bonus"])


def busy_for(seconds: float) -> None:
    """Compute (a matmul loop, which lets go of the GIL) until ``seconds`` of wall time have passed."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.mm(a, a)


def generated(answers: list[list[int]]):
    """Two prompts (ids 11, 12) of one token each, two answers per prompt."""
    seqs = [[1] + a for a in answers]
    return pack_sequences(seqs, group_size=2, prompt_lens=[1] * len(seqs), ids=[11, 12])


def one_step(reward_fn: str, answers: list[list[int]], *, overlap: bool, on_error: str = "zero"):
    """``Worker.run_step`` over OPS on rank 0: (wall seconds, the rewards actor_train received, heartbeat lines)."""
    cfg = config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": reward_fn,
                            "models": {"actor": {"path": "p"}, "ref": {"path": "p"}}, "algo": {"group_size": 2},
                            "rewards": {"workers": 4, "on_error": on_error}})
    algo = get_algorithm("grpo")
    state = algo.init_state(cfg, Letters())
    pool = RewardPool(cfg.rewards.workers) if overlap else None
    call = CallContext(sample_fields={11: {"bonus": 10}, 12: {"bonus": 20}},
                       scoring=RewardScoring(pool) if pool is not None else None)
    received, said = {}, []

    def run(op, step, data, record):
        if op.mfc == "actor_gen":
            batch = algo.after_generate(op.mfc, generated(answers), cfg, state, call)
            data.keep(op.mfc, batch, call.scoring.take(op.mfc) if call.scoring is not None else None)
        elif op.mfc == "ref_inf":
            busy_for(S)
        else:
            received.update({k: v for part in data.inputs[op.mfc] for k, v in part.seqs.items()})

    def transfer(op, data):
        data.inputs.setdefault(op.mfc, []).append(data.outputs[op.producer].only((op.key,)))
        return 0

    rank = SimpleNamespace(rank=0, ops=OPS, train_set=None, router=SimpleNamespace(begin_step=lambda ids, ds: None),
                           heartbeat=SimpleNamespace(doing=lambda what, waiting=False: said.append(what)),
                           handlers=SimpleNamespace(run=run, transfer=transfer),
                           clock=SimpleNamespace(now_synced=time.perf_counter))
    rank._move = lambda op, moves, data, handlers: Worker._move(rank, op, moves, data, handlers)
    began = time.perf_counter()
    try:
        Worker.run_step(rank, 0, [11, 12])
    finally:
        if pool is not None:
            pool.close()
    return time.perf_counter() - began, received.get("rewards"), said


@pytest.fixture(autouse=True)
def registered():
    rewards.register_reward("slow_batched", slow_batched)
    rewards.register_reward("slow_sample", slow_sample)


@pytest.mark.parametrize("reward_fn", ["slow_batched", "slow_sample"])
def test_scoring_overlaps_the_next_op_and_gives_the_blocking_paths_rewards(reward_fn):
    answers = [[1], [2, 3], [4, 5, 6], [7]]  # a | bc, def | g
    overlapped, got, said = one_step(reward_fn, answers, overlap=True)
    blocking, expected, _ = one_step(reward_fn, answers, overlap=False)
    assert expected.tolist() == [11.0, 12.0, 23.0, 21.0] and got.dtype == torch.float32
    assert torch.equal(got, expected)
    assert blocking >= 2 * S and overlapped < 1.5 * S, (overlapped, blocking)
    # waiting for the rewards is named as the generate MFC's own work, just before their transfer
    assert said[said.index("step 1: run ref_inf") + 1:] == [
        "step 1: transfer seqs actor_gen -> actor_train", "step 1: run actor_gen",
        "step 1: transfer rewards actor_gen -> actor_train", "step 1: run actor_train"]


def test_a_reward_that_raises_stops_the_step_with_the_same_message(capsys):
    boom = [[1], [2, 15, 15, 13], [3], [4]]  # "boom" is sample 11's second answer
    for overlap in (True, False):
        with pytest.raises(RewardError, match=r"^reward slow_sample: sample 11 raised ValueError: cannot parse; "
                                              r"fix the reward \(or set rewards.on_error=zero"):
            one_step("slow_sample", boom, overlap=overlap, on_error="stop")
        _, got, _ = one_step("slow_sample", boom, overlap=overlap)  # on_error: zero scores it 0 and goes on
        assert got.tolist() == [11.0, 0.0, 21.0, 21.0]
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["restage: reward slow_sample: sample 11 raised ValueError: cannot parse; scored 0 "
                     "(rewards.on_error=stop stops the run instead)"] * 2


def test_a_batched_reward_that_raises_stops_the_step_and_nan_reaches_the_nonfinite_guard():
    def broken(prompts, answers):
        raise ValueError("reward function broke on purpose")

    rewards.register_reward("broken_test", broken)
    for overlap in (True, False):
        with pytest.raises(ValueError, match="^reward function broke on purpose$"):
            one_step("broken_test", [[1], [2], [3], [4]], overlap=overlap)
        _, got, _ = one_step("slow_batched", [[14, 1, 14], [2], [3], [4]], overlap=overlap)  # "nan" first
        assert math.isnan(got[0]) and got[1:].tolist() == [11.0, 21.0, 21.0]  # the trainer's guard sees it
