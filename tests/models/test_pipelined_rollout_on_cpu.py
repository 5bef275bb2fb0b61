"""The pipelined schedule's host logic on one process (pp = 1 runs it too): micro-groups give the one-group tokens.

Admission into a group's free slots from the shared queue, prefix copies across groups, per-group
checks, compaction and retirement at max length all run here without a spawn; the multirank test
(``test_pipelined_rollout_multirank.py``) runs the same schedule over real stages.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_cases import sample_sequences

from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.rollout.budget import RolloutLimits
from restage.rollout.engine import RolloutEngine
from restage.rollout.generation import generate
from restage.rollout.pipelined import PipelinedRollout
from restage.rollout.sampling import SamplingParams, request_keys
from restage.rollout.slots import slot_groups

PROMPTS = sample_sequences([6, 1, 14, 9, 3, 11, 7], seed=5)
CAPS = [(r * 7) % 12 + 1 for r in range(len(PROMPTS) * 2)]
EOS = tuple(range(3, 40))
PARAMS = {"greedy": SamplingParams(max_new_tokens=12, greedy=True, eos_token_ids=EOS),
          "sampled": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3, eos_token_ids=EOS)}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], Layout((0,), Strategy()), None, 0)


def test_slot_groups_cover_the_slots_in_near_equal_consecutive_runs():
    assert [(g.start, g.size) for g in slot_groups(7, 3)] == [(0, 2), (2, 2), (4, 3)]
    assert [(g.start, g.size) for g in slot_groups(1, 2)] == [(0, 0), (0, 1)]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_micro_groups_give_the_one_group_tokens(llama, mode):
    def run(pp_groups):
        return generate(llama, PROMPTS, PARAMS[mode], group_size=2, max_new_tokens=CAPS,
                        limits=RolloutLimits(max_slots=5, check_every_steps=3, pp_groups=pp_groups))

    one = run(1)
    lengths = one.lengths.tolist()
    assert len(set(lengths)) >= 4 and any(n < c for n, c in zip(lengths, CAPS))  # EOS and caps end answers
    for pp_groups in (2, 3, 5):
        out = run(pp_groups)
        assert out.sequences() == one.sequences(), pp_groups
        torch.testing.assert_close(out.logprobs, one.logprobs, rtol=0, atol=1e-5)


def test_pp_groups_below_pp_is_refused(llama):
    with pytest.raises(ConfigError, match="pp_groups=0"):
        generate(llama, PROMPTS[:1], PARAMS["greedy"], limits=RolloutLimits(pp_groups=0))


_SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")


@pytest.mark.parametrize("k", [1, 4])
def test_each_group_syncs_once_per_k_of_its_steps(llama, monkeypatch, k):
    """Only a group's check reads the device; a decode-only event makes no host wait."""
    counts = {"syncs": 0, "in_decode": 0, "in_plan": 0, "checks": 0}
    where = {"decode": False, "plan": False}
    for name in _SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["syncs"] += 1
            counts["in_decode"] += where["decode"]
            counts["in_plan"] += where["plan"]
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    forward = PipelinedRollout._forward

    def flagged(self, event, inputs):
        where["decode"] = event.admission is None
        counts["checks"] += event.check and event.bound > 0
        try:
            return forward(self, event, inputs)
        finally:
            where["decode"] = False

    plan = PipelinedRollout._plan

    def planning(self, index):
        where["plan"] = True
        try:
            return plan(self, index)
        finally:
            where["plan"] = False

    monkeypatch.setattr(PipelinedRollout, "_forward", flagged)
    monkeypatch.setattr(PipelinedRollout, "_plan", planning)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, eos_token_ids=())
    engine = RolloutEngine(llama, PROMPTS[:4], [0, 0, 1, 2, 3, 3], [24] * 6, request_keys(range(6)), params, [],
                           RolloutLimits(max_slots=6, check_every_steps=k, pp_groups=2))
    runner = PipelinedRollout(engine)
    runner.run()
    decoded = runner.log.decoded_slots
    assert sum(d > 0 for d in decoded) == 2 * 24  # both groups of 3 slots, 24 steps each
    assert counts["in_decode"] == 0
    assert counts["checks"] == 2 * math.ceil(24 / k)
    # One read per check of a group already decoding (not its first, before it holds requests, nor after the last step).
    assert counts["in_plan"] == counts["checks"] - 2
