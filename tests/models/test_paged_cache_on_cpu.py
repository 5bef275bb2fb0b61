"""The paged KV cache on one process: the same tokens and log-probs as the contiguous cache (greedy and sampled,
pipelined micro-groups, partial rollouts), a group's prompt held once, blocks given back at EOS, preemption that
recomputes to the same answers, compaction without copies, and the block bookkeeping itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_cases import sample_sequences

from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.rollout.budget import RolloutLimits, kv_bytes_per_slot
from restage.rollout.engine import RolloutEngine
from restage.rollout.generation import generate
from restage.rollout.paged_cache import PagedKVCache, blocks_for
from restage.rollout.sampling import SamplingParams, request_keys

ONE_RANK = Layout((0,), Strategy())
PROMPTS = sample_sequences([6, 1, 21, 9, 17, 11, 33, 2], seed=5)  # prompts across 1-3 blocks of 16
GROUP = 3
CAPS = [(r * 7) % 20 + 1 for r in range(len(PROMPTS) * GROUP)]  # answers end at many lengths
EOS = tuple(range(3, 30))
PARAMS = {"greedy": SamplingParams(max_new_tokens=20, greedy=True, eos_token_ids=EOS),
          "sampled": SamplingParams(max_new_tokens=20, temperature=0.9, top_k=40, seed=3, eos_token_ids=EOS)}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], ONE_RANK, None, 0)


def _engines(monkeypatch) -> list[RolloutEngine]:
    seen: list[RolloutEngine] = []
    original = RolloutEngine.__init__

    def recorded(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append(self)

    monkeypatch.setattr(RolloutEngine, "__init__", recorded)
    return seen


def _block_budget(module, blocks: int, block_tokens: int = 16) -> int:
    return blocks * kv_bytes_per_slot(module, block_tokens)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("pp_groups", [None, 3])
def test_paged_equals_contiguous_and_preemption_recomputes_the_same_answers(llama, monkeypatch, mode, pp_groups):
    params = PARAMS[mode]
    kwargs = dict(group_size=GROUP, max_new_tokens=CAPS)
    contiguous = generate(llama, PROMPTS, params, limits=RolloutLimits(max_slots=8, paged=False,
                                                                      pp_groups=pp_groups), **kwargs)
    engines = _engines(monkeypatch)
    paged = generate(llama, PROMPTS, params, limits=RolloutLimits(max_slots=8, pp_groups=pp_groups, paged=True),
                     **kwargs)
    # 3 blocks per micro-group: the longest sequence (33 + 14 tokens) fills them. Without EOS every answer runs to
    # its cap, so the requests of a pool outgrow it and the newest are preempted, whatever the tiny model samples.
    groups = 3 if pp_groups else 1
    tight = RolloutLimits(max_slots=8, pp_groups=pp_groups, paged=True,
                          kv_cache_bytes=_block_budget(llama, 3 * groups))
    to_caps = dataclasses.replace(params, eos_token_ids=())
    squeezed = generate(llama, PROMPTS, to_caps, limits=tight, **kwargs)
    reference = generate(llama, PROMPTS, to_caps, limits=RolloutLimits(max_slots=8, paged=False, pp_groups=pp_groups),
                         **kwargs)
    assert [e.preempted for e in engines[:2]] == [0, engines[1].preempted] and engines[1].preempted >= 2
    assert engines[1].cache is not None and engines[1].cache.num_blocks == 3 * groups
    for out, expected in ((paged, contiguous), (squeezed, reference)):
        assert out.sequences() == expected.sequences()
        torch.testing.assert_close(out.logprobs, expected.logprobs, rtol=0, atol=1e-5)
        assert torch.equal(out.lengths, expected.lengths)
    assert squeezed.lengths.tolist() == CAPS
    assert len({len(s) for s in contiguous.sequences()}) >= 6  # many lengths: EOS and the caps


def test_a_group_holds_its_prompt_once_and_gives_blocks_back(llama):
    prompt = sample_sequences([37], seed=2)[0]  # 36 prefilled positions: 2 full blocks of 16 and 4 in a third
    engine = RolloutEngine(llama, [prompt], [0] * 4, [8] * 4, request_keys(range(4)), PARAMS["greedy"], [],
                           RolloutLimits(paged=True))
    cache = engine.cache
    assert isinstance(cache, PagedKVCache) and cache.block_tokens == 16
    engine._admit(join_if_empty=False)
    full = cache.held[0][:2]
    assert all(cache.held[s][:2] == full for s in range(4))  # the prompt's full blocks: one copy for the group
    assert len({b for s in range(4) for b in cache.held[s]}) == 2 + 4  # + each sibling's own third block
    assert [cache.refs[b] for b in full] == [4, 4]
    shared_bytes = cache.blocks_held() * kv_bytes_per_slot(llama, 16)
    assert shared_bytes == 6 * kv_bytes_per_slot(llama, 16) < 4 * kv_bytes_per_slot(llama, 37)
    # Every sibling's copied third block holds the very keys the prefill wrote into the first one's.
    for layer in cache.k:
        first = cache.k[layer][cache.held[0][2], :4]
        assert first.abs().sum() > 0
        for s in range(1, 4):
            assert torch.equal(cache.k[layer][cache.held[s][2], :4], first)
    engine.run()
    assert cache.blocks_held() == 0 and sorted(cache.free[0]) == list(range(cache.num_blocks))
    assert cache.peak_blocks == 2 + 4  # 36 + 8 positions: the answers stayed in the third block


def test_block_bookkeeping_counts_shares_and_refuses_without_room():
    cache = PagedKVCache([0], rows=4, max_len=40, block_tokens=8, num_blocks=6, kv_heads=1, head_dim=2,
                         dtype=torch.float32, device="cpu", pools=[(0, 2), (2, 4)])
    assert [cache.pool_blocks(r) for r in range(4)] == [3, 3, 3, 3] and blocks_for(17, 8) == 3
    assert cache.hold(0, 17) and cache.held[0] == [0, 1, 2]
    assert not cache.hold(1, 1)  # pool 0 is full: nothing taken
    assert not cache.hold(1, 17, share_from=0, shared_tokens=16)  # 2 blocks shared, 1 new: none free
    assert cache.held[1] == [] and cache.refs[:3] == [1, 1, 1]
    cache.release(0)
    assert sorted(cache.free[0]) == [0, 1, 2] and cache.refs[:3] == [0, 0, 0]
    assert cache.hold(0, 16) and cache.hold(1, 17, share_from=0, shared_tokens=16)
    assert cache.held[1][:2] == cache.held[0] and cache.refs[cache.held[0][0]] == 2 and cache.free[0] == []
    assert cache.hold(2, 9, share_from=0, shared_tokens=16) and cache.held[2] == [3, 4]  # other pool: no sharing
    cache.release(0)
    assert [cache.refs[b] for b in cache.held[1]] == [1, 1, 1] and cache.free[0] == []
    cache.move(2, 3, 9)
    assert cache.held[3] == [3, 4] and cache.held[2] == []
    cache.flush()
    assert cache.table[3, :2].tolist() == [3, 4] and cache.table[2].tolist() == [cache.scratch] * 5
    with pytest.raises(AssertionError):
        cache.move(1, 3, 1)  # the target holds blocks


def test_a_budget_below_one_sequence_per_group_is_refused(llama):
    per_row = blocks_for(33 + 20, 16)
    with pytest.raises(ConfigError, match="raise generation.kv_cache_gib"):
        generate(llama, PROMPTS, PARAMS["greedy"],
                 limits=RolloutLimits(paged=True, kv_cache_bytes=_block_budget(llama, per_row - 1)))
    with pytest.raises(ConfigError, match="in each of 3 micro-group"):
        generate(llama, PROMPTS, PARAMS["greedy"], limits=RolloutLimits(
            pp_groups=3, paged=True, kv_cache_bytes=_block_budget(llama, 3 * per_row - 1)))
    out = generate(llama, PROMPTS, PARAMS["greedy"],
                   limits=RolloutLimits(paged=True, kv_cache_bytes=_block_budget(llama, per_row)))
    assert out.lengths.min() >= 1


def test_compaction_moves_block_tables_without_copying(llama, monkeypatch):
    copies: list[int] = []
    monkeypatch.setattr(PagedKVCache, "copy_prefix", lambda self, s, t, n: copies.append(n))
    engine = RolloutEngine(llama, PROMPTS[:1], [0] * 4, [1, 1, 1, 12], request_keys(range(4)), PARAMS["greedy"], [],
                           RolloutLimits(check_every_steps=1, paged=True))
    engine._admit(join_if_empty=False)
    before = engine.cache.held[3]
    engine._decode()  # requests 0-2 leave at their cap; the 4th moves down to slot 0 at the next check
    engine.reap()
    assert [engine.slots.request(i) for i in range(4)] == [3, None, None, None]
    assert engine.cache.held[0] == before and engine.cache.held[3] == []
    assert copies == [5]  # only the admission's prefix copy (three siblings, one call); the move copied nothing
