"""Partial rollouts in the engine (``generation.continue_generate``): a batch finished while the next one starts in
the slots it frees, then that next batch continued in a later call (prompt + answer so far prefilled again),
equals one uninterrupted ``generate`` of each batch token for token."""

from __future__ import annotations

import pytest
import torch
from model_cases import sample_sequences

from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.rollout.budget import RolloutLimits
from restage.rollout.engine import RolloutEngine
from restage.rollout.generation import PartialRequest, continue_generate, generate
from restage.rollout.sampling import SamplingParams

ONE_RANK = Layout((0,), Strategy())
GROUP = 2
# Three batches of four prompts (two samples each); a few EOS ids end answers at different lengths.
BATCHES = [sample_sequences([6, 1, 9, 4], seed=21), sample_sequences([3, 7, 2, 10], seed=22),
           sample_sequences([5, 8, 1, 6], seed=23)]


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], ONE_RANK, None, 0)


def _params(eos: tuple[int, ...]) -> SamplingParams:
    return SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, eos_token_ids=eos, seed=0)


def _seeds(batch: int) -> list[int]:
    return [10_000 * (batch + 1) + r for r in range(len(BATCHES[batch]) * GROUP)]


def _fresh(batch: int) -> list[PartialRequest]:
    return [PartialRequest(tuple(BATCHES[batch][r // GROUP]), seed) for r, seed in enumerate(_seeds(batch))]


def _carried(requests: list[PartialRequest], out, rows: range) -> tuple[list[PartialRequest], list[list[int]]]:
    """The requests of ``rows`` as the next call gets them: finished ones apart, the rest with their answer so far."""
    answers = out.output.sequences()
    logprobs = out.output.token_logprobs()
    carried, done = [], []
    for row in rows:
        if out.finished[row]:
            done.append(row)
        else:
            carried.append(PartialRequest(requests[row].prompt, requests[row].seed, tuple(answers[row]),
                                          tuple(logprobs[row])))
    return carried, done


def test_continued_batches_equal_uninterrupted_generation(llama):
    eos = (3, 17, 40, 101, 150, 201, 230)
    params = _params(eos)
    whole = [generate(llama, BATCHES[b], params, group_size=GROUP, seeds=_seeds(b)) for b in range(3)]
    limits = RolloutLimits(max_slots=5, check_every_steps=2)

    # Call 1: batch 0 must finish; batch 1 starts in the slots batch 0 frees.
    first = _fresh(0) + _fresh(1)
    n = len(first) // 2
    out1 = continue_generate(llama, first, params, must_finish=n, limits=limits)
    assert all(out1.finished[:n])
    assert out1.output.sequences()[:n] == whole[0].sequences()
    torch.testing.assert_close(out1.output.logprobs[:n], whole[0].logprobs, rtol=0, atol=1e-5)
    carried, done = _carried(first, out1, range(n, 2 * n))
    in_flight = [r for r in carried if r.answer]
    assert 0 < len(in_flight) <= limits.max_slots  # some of batch 1 really was cut mid-answer

    # Call 2: batch 1 (cut answers continued, the rest fresh) must finish; batch 2 starts behind it.
    second = carried + _fresh(2)
    out2 = continue_generate(llama, second, params, must_finish=len(carried), limits=limits)
    assert all(out2.finished[:len(carried)])
    answers = dict(zip([r.seed for r in second], out2.output.sequences()))
    lps = dict(zip([r.seed for r in second], out2.output.logprobs))
    expected = whole[1].sequences()
    for row, seed in enumerate(_seeds(1)):
        got = out1.output.sequences()[n + row] if n + row in done else answers[seed]
        assert got == expected[row], f"request {row} of batch 1"
        if n + row not in done:
            torch.testing.assert_close(lps[seed], whole[1].logprobs[row], rtol=0, atol=1e-5)
    # Batch 2's started answers are the prefixes of its uninterrupted ones.
    for row, seed in enumerate(_seeds(2)):
        answer = answers[seed]
        assert answer == whole[2].sequences()[row][:len(answer)]


def test_the_cache_holds_the_must_finish_requests_only(llama):
    """Later requests start only in slots the first free: M slots for M required requests."""
    requests = _fresh(0) + _fresh(1)
    params = _params(())
    limits = RolloutLimits(check_every_steps=4)
    engine = RolloutEngine(llama, [r.prompt for r in requests], list(range(len(requests))), [10] * len(requests),
                           torch.zeros(len(requests), dtype=torch.int64), params, [], limits, must_finish=8)
    assert engine.num_slots == 8
    _, _, lengths = engine.run()
    # No EOS: the first 8 leave at max length together, after decode 10, which the host knows without a check:
    # the engine stops there, before the later 8 (admitted only into freed slots) decoded a token.
    assert lengths[:8].tolist() == [10] * 8 and lengths[8:].tolist() == [0] * 8
    assert engine.unfinished() == list(range(8, 16))
    # With EOS the engine stops at the check that sees the last required answer end: fewer than
    # check_every_steps decodes after it, which the later requests (taking the freed slots) decoded.
    eos = (3, 17, 40, 101, 150, 201, 230)
    engine = RolloutEngine(llama, [r.prompt for r in requests], list(range(len(requests))), [10] * len(requests),
                           torch.arange(len(requests)), _params(eos), list(eos), limits, must_finish=8)
    _, _, lengths = engine.run()
    assert (lengths[:8] >= 1).all() and engine.num_slots == 8
    assert 0 < int(lengths[8:].sum()) and int(lengths[8:].max()) <= 10 - 1


def test_bad_requests_are_refused_in_one_line(llama):
    params = _params(())
    with pytest.raises(ConfigError, match="must_finish"):
        continue_generate(llama, _fresh(0), params, must_finish=len(_fresh(0)) + 1)
    idle = continue_generate(llama, _fresh(0), params, must_finish=0)  # nothing required: no slot, no token
    assert idle.output.lengths.tolist() == [0] * len(_fresh(0)) and not any(idle.finished)
    full = PartialRequest((1, 2), 0, tuple(range(10)), (0.0,) * 10)
    with pytest.raises(ConfigError, match="fewer than max_new_tokens"):
        continue_generate(llama, [full], params, must_finish=1)
