"""The rollout engine on one process: batch invariance, shared prefill, continuous batching, exact logprobs, syncs."""

from __future__ import annotations

import math

import pytest
import torch
from model_cases import PROMPTS, logprob_gap_to_teacher_forcing, sample_sequences

from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.models.attention import KVCache
from restage.models.hf_checkpoint import load_stage
from restage.rollout.budget import RolloutLimits, kv_bytes_per_slot, plan_slots
from restage.rollout.engine import RolloutEngine
from restage.rollout.generation import generate
from restage.rollout.sampling import SamplingParams, choose_tokens, request_keys

ONE_RANK = Layout((0,), Strategy())
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, seed=7)
# Ten prompts from 1 to 14 tokens: more requests than the slots below, one prompt of a single token.
MANY = sample_sequences([6, 1, 14, 9, 3, 11, 7, 2, 12, 5], seed=11)


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], ONE_RANK, None, 0)


def _eos(module, prompts, params) -> int:
    """A token the greedy answers reach at different steps, so EOS ends them at different lengths."""
    answers = generate(module, prompts, SamplingParams(max_new_tokens=params.max_new_tokens, greedy=True,
                                                       eos_token_ids=())).sequences()
    counts: dict[int, int] = {}
    for a in answers:
        for t in set(a[2:]):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=lambda t: counts[t])


def test_sampled_tokens_of_a_request_do_not_depend_on_its_batch(llama):
    group = 3
    seeds = [1000 + r for r in range(len(MANY) * group)]
    caps = [(r * 5) % 12 + 1 for r in range(len(seeds))]  # slots free at different steps
    full = generate(llama, MANY, SAMPLED, group_size=group, seeds=seeds, max_new_tokens=caps,
                    limits=RolloutLimits(max_slots=8))
    for r in (0, 4, 5, 8, 17, 29):  # 8: admitted later, its prompt copied from a sibling still decoding
        alone = generate(llama, [MANY[r // group]], SAMPLED, seeds=[seeds[r]], max_new_tokens=[caps[r]])
        assert alone.sequences()[0] == full.sequences()[r]
        torch.testing.assert_close(alone.logprobs[0], full.logprobs[r], rtol=0, atol=1e-5)
    same_caps = generate(llama, MANY[:1], SAMPLED, group_size=group)
    assert len({tuple(s) for s in same_caps.sequences()}) == group  # a group's samples differ


def test_a_group_prefilled_once_equals_its_prompt_prefilled_per_sample(llama, monkeypatch):
    group = 4
    seeds = list(range(len(PROMPTS) * group))
    prefilled: list[int] = []
    original = RolloutEngine._prefill

    def counted(self, slots, prefixes):
        prefilled.extend(len(p) for p in prefixes)
        original(self, slots, prefixes)

    monkeypatch.setattr(RolloutEngine, "_prefill", counted)
    shared = generate(llama, PROMPTS, SAMPLED, group_size=group, seeds=seeds)
    assert sorted(prefilled) == sorted(len(p) - 1 for p in PROMPTS)  # each prompt once, not once per sample
    separate = generate(llama, [p for p in PROMPTS for _ in range(group)], SAMPLED, seeds=seeds)
    assert len(prefilled) == len(PROMPTS) * (1 + group)
    assert shared.sequences() == separate.sequences()
    torch.testing.assert_close(shared.logprobs, separate.logprobs, rtol=0, atol=1e-5)  # batch shapes differ
    # The copied prefix holds the very keys/values a prefill of that row computes.
    engine = RolloutEngine(llama, PROMPTS, [0, 0, 1], [4, 4, 4], request_keys([0, 1, 2]), SAMPLED, [],
                           RolloutLimits(paged=False))
    engine._admit(join_if_empty=False)
    assert engine.cache is not None
    for layer in engine.cache.k:
        n = len(PROMPTS[0]) - 1
        assert torch.equal(engine.cache.k[layer][1, :n], engine.cache.k[layer][0, :n])
        assert engine.cache.k[layer][0, :n].abs().sum() > 0


def test_a_group_copies_its_prefix_to_all_siblings_at_once(llama, monkeypatch):
    """One ``copy_prefix`` per prompt, to its group - 1 siblings together (not one call per sibling)."""
    calls: list[tuple[int, list[int], int]] = []
    original = KVCache.copy_prefix

    def recorded(self, source, targets, num_tokens):
        calls.append((source, list(targets), num_tokens))
        original(self, source, targets, num_tokens)

    monkeypatch.setattr(KVCache, "copy_prefix", recorded)
    # 16 requests, 16 slots: every group admitted at once (the contiguous cache; paged_cache shares full blocks)
    generate(llama, PROMPTS, SAMPLED, group_size=4, limits=RolloutLimits(paged=False))
    assert sorted(n for _, _, n in calls) == sorted(len(p) - 1 for p in PROMPTS)
    assert all(len(targets) == 3 and source not in targets for source, targets, _ in calls)
    assert sorted(t for _, targets, _ in calls for t in targets) == sorted(
        set(range(16)) - {source for source, _, _ in calls})


def test_more_prompts_than_slots_each_answer_equals_its_run_alone(llama):
    params = SamplingParams(max_new_tokens=10, greedy=True)
    params = SamplingParams(max_new_tokens=10, greedy=True, eos_token_ids=(_eos(llama, MANY, params),))
    caps = [10, 3, 10, 7, 10, 1, 10, 10, 5, 10]  # per-request max lengths
    out = generate(llama, MANY, params, max_new_tokens=caps, limits=RolloutLimits(max_slots=3, check_every_steps=4))
    lengths = out.lengths.tolist()
    assert len(set(lengths)) >= 4 and max(lengths) == 10  # EOS and the caps end answers at many lengths
    for i, prompt in enumerate(MANY):
        alone = generate(llama, [prompt], params, max_new_tokens=[caps[i]])
        assert alone.sequences()[0] == out.sequences()[i]
        assert out.tokens[i, lengths[i]:].eq(0).all() and out.logprobs[i, lengths[i]:].eq(0).all()


def test_logprobs_equal_a_teacher_forced_forward(llama):
    out = generate(llama, MANY, SAMPLED, group_size=2, limits=RolloutLimits(max_slots=5, check_every_steps=3))
    prompts = [p for p in MANY for _ in range(2)]
    assert logprob_gap_to_teacher_forcing(llama, prompts, out, SAMPLED.temperature) <= 1e-5


def test_gumbel_sampling_follows_the_filtered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).expand(20000, 5)
    rows = logits.shape[0]
    kwargs = dict(greedy=False, temperature=1.0, eos=torch.tensor([], dtype=torch.int64),
                  allow_eos=torch.ones(rows, dtype=torch.bool), keys=request_keys(range(rows)),
                  steps=torch.zeros(rows, dtype=torch.int64))
    tokens, _ = choose_tokens(logits, top_k=0, top_p=1.0, min_p=0.0, **kwargs)
    frequencies = torch.bincount(tokens, minlength=5).float() / rows
    torch.testing.assert_close(frequencies, logits[0].softmax(-1), rtol=0, atol=0.01)
    tokens, _ = choose_tokens(logits, top_k=0, top_p=1.0, min_p=0.3, **kwargs)  # keeps p >= 0.3 x 0.64: tokens 0, 1
    frequencies = torch.bincount(tokens, minlength=5).float() / rows
    torch.testing.assert_close(frequencies[:2], logits[0, :2].softmax(-1), rtol=0, atol=0.01)
    assert frequencies[2:].sum() == 0
    tokens, _ = choose_tokens(logits, top_k=3, top_p=1.0, min_p=0.0, **kwargs)
    frequencies = torch.bincount(tokens, minlength=5).float() / rows
    torch.testing.assert_close(frequencies[:3], logits[0, :3].softmax(-1), rtol=0, atol=0.01)


def test_slots_come_from_the_memory_budget(llama, monkeypatch):
    per_slot = kv_bytes_per_slot(llama, 40)
    cfg = llama.cfg
    assert per_slot == 2 * cfg.num_layers * 40 * cfg.num_kv_heads * cfg.head_dim * 4
    assert plan_slots(llama, 100, 40, RolloutLimits(kv_cache_bytes=3 * per_slot + 1)) == 3
    assert plan_slots(llama, 2, 40, RolloutLimits(kv_cache_bytes=30 * per_slot)) == 2
    with pytest.raises(ConfigError, match="kv_cache_bytes"):
        plan_slots(llama, 1, 40, RolloutLimits(kv_cache_bytes=per_slot - 1))
    # generate takes the budget from the generation config: a tiny one is refused, max_slots bounds the engine.
    with pytest.raises(ConfigError, match="kv_cache"):
        generate(llama, PROMPTS, SamplingParams(max_new_tokens=4, greedy=True, kv_cache_gib=1e-9))
    seen: list[int] = []
    original = RolloutEngine.run
    monkeypatch.setattr(RolloutEngine, "run", lambda self: seen.append(self.num_slots) or original(self))
    generate(llama, PROMPTS, SamplingParams(max_new_tokens=4, greedy=True, max_slots=2))
    assert seen == [2]


_SYNCS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")


@pytest.mark.parametrize("k", [1, 4, 8])
def test_the_decode_loop_syncs_once_per_k_steps(llama, monkeypatch, k):
    """Every call that makes a host wait for a device is counted; only the check every k steps may make one."""
    counts = {"syncs": 0, "in_prefill": 0, "decode_steps": 0, "in_decode": 0}
    where = {"prefill": False, "decode": False}
    for name in _SYNCS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            counts["syncs"] += 1
            counts["in_prefill"] += where["prefill"]
            counts["in_decode"] += where["decode"]
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for method, flag in (("_prefill", "prefill"), ("_decode", "decode")):
        original = getattr(RolloutEngine, method)

        def wrapped(self, *args, _original=original, _flag=flag, **kwargs):
            where[_flag] = True
            counts["decode_steps"] += _flag == "decode"
            try:
                return _original(self, *args, **kwargs)
            finally:
                where[_flag] = False

        monkeypatch.setattr(RolloutEngine, method, wrapped)
    params = SamplingParams(max_new_tokens=24, temperature=0.9, top_p=0.9, eos_token_ids=())
    engine = RolloutEngine(llama, MANY[:4], [0, 0, 1, 2, 3, 3], [24] * 6, request_keys(range(6)), params, [],
                           RolloutLimits(max_slots=6, check_every_steps=k))
    engine.run()
    assert counts["decode_steps"] == 24 and counts["in_decode"] == 0
    loop_syncs = counts["syncs"] - counts["in_prefill"]
    assert counts["decode_steps"] // k - 1 <= loop_syncs <= math.ceil(counts["decode_steps"] / k)  # the trap sees the checks


def test_a_long_answer_left_alone_moves_to_the_first_slot(llama, monkeypatch):
    params = SamplingParams(max_new_tokens=12, greedy=True, eos_token_ids=())
    bounds: list[int] = []
    original = RolloutEngine._decode

    def recorded(self):
        bounds.append(self.bound())
        original(self)

    monkeypatch.setattr(RolloutEngine, "_decode", recorded)
    out = generate(llama, PROMPTS, params, max_new_tokens=[2, 2, 2, 12], limits=RolloutLimits(check_every_steps=2))
    assert bounds == [4, 4] + [1] * 10  # the fourth request decodes alone in slot 0 after the first check
    monkeypatch.setattr(RolloutEngine, "_decode", original)
    for i, prompt in enumerate(PROMPTS):
        assert out.sequences()[i] == generate(llama, [prompt], params, max_new_tokens=[[2, 2, 2, 12][i]]).sequences()[0]


def test_a_stop_id_past_the_vocabulary_never_stops_an_answer(llama):
    out = generate(llama, PROMPTS, SamplingParams(max_new_tokens=5, greedy=True, eos_token_ids=(llama.cfg.vocab_size + 3,)))
    assert out.lengths.tolist() == [5] * len(PROMPTS)


def test_a_sample_is_answered_alike_whichever_share_of_the_batch_holds_it(llama):
    # The runtime seeds each request by the step and the sample's dataset id (execute.request_seeds): split over two
    # dp ranks (in another order), every sample gets the answer it gets in one rank's whole batch. Seeding by the
    # request's place in its rank's share (the old rule) gave other answers once the share changed.
    from restage.data.batch import pack_sequences
    from restage.runtime.step.execute import request_seeds

    ids = [40, 7, 13, 2, 99, 5]
    prompts = MANY[:6]
    whole = pack_sequences(prompts, key="prompts", ids=ids)
    group = 2

    def answers(batch, rows):
        out = generate(llama, [prompts[r] for r in rows], SAMPLED, group_size=group,
                       seeds=request_seeds(batch, group, seed=1234))
        return {(batch.ids[i], j): seq for i in range(len(rows)) for j, seq in
                enumerate(out.sequences()[i * group:(i + 1) * group])}

    one_rank = answers(whole, range(6))
    shares = {}
    for rows in ([4, 0, 2], [5, 3, 1]):
        shares.update(answers(pack_sequences([prompts[r] for r in rows], key="prompts", ids=[ids[r] for r in rows]),
                              rows))
    assert shares == one_rank
    assert len({tuple(a) for a in one_rank.values()}) > len(ids)  # sampled: a group's two answers differ somewhere
