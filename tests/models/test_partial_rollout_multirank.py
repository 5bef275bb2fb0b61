"""Partial rollouts (``generation.continue_generate``) on 4 real gloo ranks under tp2 x pp2 and dp2 x pp2: a batch
finished while the next begins, then the next continued in a second call, gives every rank of every replica the
tokens one whole-batch ``generate`` under dp4 gives. Under expert parallelism (a mixture, dp4 ep2 and dp2 ep2 pp2)
the replicas of an ep group step together, one of them with nothing to generate, and each replica's answers
equal its whole-batch generation under the same layout."""

from __future__ import annotations

import pytest
from model_cases import sample_sequences

from restage.layout import Strategy

pytestmark = pytest.mark.multirank

LAYOUTS = {"dp4": Strategy(dp=4), "pp2": Strategy(dp=2, pp=2), "tp2pp2": Strategy(tp=2, pp=2)}
BATCHES = [sample_sequences([5, 11, 1, 8], seed=31), sample_sequences([3, 9, 6, 2], seed=32)]
GROUP = 2
EOS = tuple(range(3, 40))  # about one token in seven stops an answer


def _run(rank, world_size, path):
    from restage.layout import Layout, ProcessGroups
    from restage.models.hf_checkpoint import load_stage
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.generation import PartialRequest, continue_generate, generate
    from restage.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=50, eos_token_ids=EOS)
    seeds = [[100 * (b + 1) + r for r in range(len(BATCHES[b]) * GROUP)] for b in range(2)]
    fresh = [[PartialRequest(tuple(BATCHES[b][r // GROUP]), seed) for r, seed in enumerate(seeds[b])] for b in range(2)]
    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    limits = RolloutLimits(max_slots=5, check_every_steps=2)
    out: dict = {}
    for key, layout in layouts.items():
        module = load_stage(path, layout, groups, rank)
        if key == "dp4":
            out["whole"] = [generate(module, BATCHES[b], params, group_size=GROUP, seeds=seeds[b]).sequences()
                            for b in range(2)]
            continue
        first = fresh[0] + fresh[1]
        n = len(fresh[0])
        one = continue_generate(module, first, params, must_finish=n, limits=limits)
        answers, logprobs = one.output.sequences(), one.output.token_logprobs()
        carried = [PartialRequest(first[r].prompt, first[r].seed, tuple(answers[r]), tuple(logprobs[r]))
                   for r in range(n, 2 * n) if not one.finished[r]]
        two = continue_generate(module, carried, params, must_finish=len(carried), limits=limits)
        final = {r.seed: a for r, a in zip(carried, two.output.sequences())}
        batch1 = [final.get(seed, answers[n + i]) for i, seed in enumerate(seeds[1])]
        out[key] = (answers[:n], batch1, sum(1 for r in carried if r.answer))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from restage.models.tiny import build_tiny
    from restage.runtime.control.spawn import spawn

    path = str(build_tiny(tmp_path_factory.mktemp("partial") / "llama", family="llama", seed=3))
    return spawn(_run, 4, path, timeout_seconds=600)


@pytest.mark.parametrize("key", ["pp2", "tp2pp2"])
def test_continued_answers_equal_whole_generation_on_every_rank(results, key):
    whole = results[0]["whole"]
    assert all(r["whole"] == whole for r in results)
    cut = []
    for rank, result in enumerate(results):
        batch0, batch1, begun = result[key]
        assert batch0 == whole[0], (key, rank)
        assert batch1 == whole[1], (key, rank)
        cut.append(begun)
    assert len(set(cut)) == 1 and cut[0] > 0  # every rank cut the same answers, and some were cut mid-way


MOE_LAYOUTS = {"dp4ep2": Strategy(dp=4, ep=2), "dp2ep2pp2": Strategy(dp=2, pp=2, ep=2)}


def _replica_batches(d: int) -> list[list[list[int]]]:
    """What dp replica d generates: both batches; nothing; one prompt each; both batches, prompts reversed."""
    return [BATCHES[0], BATCHES[1]] if d == 0 else [[], []] if d == 1 else (
        [BATCHES[0][:1], BATCHES[1][1:2]] if d == 2 else [BATCHES[0][::-1], BATCHES[1][::-1]])


def _run_moe(rank, world_size, path):
    from restage.layout import Layout, ProcessGroups
    from restage.models.hf_checkpoint import load_stage
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.generation import PartialRequest, continue_generate, generate
    from restage.rollout.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=12, temperature=0.8, top_k=50, eos_token_ids=EOS)
    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in MOE_LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    limits = RolloutLimits(max_slots=5, check_every_steps=2)
    out: dict = {}
    for key, layout in layouts.items():
        module = load_stage(path, layout, groups, rank)
        d = module.ctx.dp_rank
        batches = _replica_batches(d)
        seeds = [[1000 * d + 100 * b + r for r in range(len(batches[b]) * GROUP)] for b in range(2)]
        whole = [generate(module, batches[b], params, group_size=GROUP, seeds=seeds[b]).sequences() for b in range(2)]
        first = [PartialRequest(tuple(batches[b][r // GROUP]), seed) for b in range(2) for r, seed in enumerate(seeds[b])]
        n = len(seeds[0])
        one = continue_generate(module, first, params, must_finish=n, limits=limits)
        answers, logprobs = one.output.sequences(), one.output.token_logprobs()
        carried = [PartialRequest(first[r].prompt, first[r].seed, tuple(answers[r]), tuple(logprobs[r]))
                   for r in range(n, len(first)) if not one.finished[r]]
        two = continue_generate(module, carried, params, must_finish=len(carried), limits=limits)
        final = {r.seed: a for r, a in zip(carried, two.output.sequences())}
        batch1 = [final.get(seed, answers[n + i]) for i, seed in enumerate(seeds[1])]
        out[key] = (d, whole, answers[:n], batch1, sum(1 for r in carried if r.answer))
    return out


@pytest.fixture(scope="module")
def moe_results(tmp_path_factory):
    from restage.models.tiny import build_tiny
    from restage.runtime.control.spawn import spawn

    path = str(build_tiny(tmp_path_factory.mktemp("partial_moe") / "mixtral", family="mixtral", seed=5))
    return spawn(_run_moe, 4, path, timeout_seconds=600)


@pytest.mark.parametrize("key", list(MOE_LAYOUTS))
def test_continued_answers_under_expert_parallelism_equal_whole_generation(moe_results, key):
    cut = 0
    replicas = set()
    for rank, result in enumerate(moe_results):
        d, whole, batch0, batch1, begun = result[key]
        replicas.add(d)
        assert batch0 == whole[0] and batch1 == whole[1], (key, rank)
        assert (len(whole[0]), len(whole[1])) == tuple(len(b) * GROUP for b in _replica_batches(d))
        cut += begun
    assert replicas == set(range(MOE_LAYOUTS[key].dp)) and cut > 0  # every replica ran; some answers were cut
