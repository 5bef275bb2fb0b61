"""The paged KV cache on 4 real gloo ranks: under dp, tp, pp (micro-groups in flight), tp x pp and ep it gives the
contiguous cache's tokens and log-probs, greedy and sampled, with a budget that preempts requests too; under tp the
graph-shaped (static) decode step gives the eager tokens with either cache."""

from __future__ import annotations

import pytest
import torch
from model_cases import sample_sequences

from restage.layout import Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

LAYOUTS = {"dp4": ("llama", Strategy(dp=4)), "dp2tp2": ("llama", Strategy(dp=2, tp=2)),
           "dp2pp2": ("llama", Strategy(dp=2, pp=2)), "tp2pp2": ("llama", Strategy(tp=2, pp=2)),
           "dp4ep2": ("mixtral", Strategy(dp=4, ep=2))}
PROMPTS = sample_sequences([5, 19, 1, 8, 23, 11], seed=7)
GROUP = 2
CAPS = [12, 3, 12, 7, 1, 12, 9, 12, 5, 12, 2, 10]
EOS = tuple(range(3, 40))
BLOCKS_PER_POOL = 3  # 23 + 12 positions need 3 blocks of 16: one sequence fills a pool, so the others are preempted


def _params(mode: str, eos: bool):
    from restage.rollout.sampling import SamplingParams

    stop = EOS if eos else ()
    if mode == "greedy":
        return SamplingParams(max_new_tokens=12, greedy=True, eos_token_ids=stop)
    return SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.95, top_k=50, seed=11, eos_token_ids=stop)


def _run(rank, world_size, paths):
    from restage.layout import Layout, ProcessGroups
    from restage.models.hf_checkpoint import load_stage
    from restage.rollout.budget import RolloutLimits, group_count, kv_bytes_per_slot
    from restage.rollout.engine import RolloutEngine
    from restage.rollout.generation import generate
    from restage.rollout.sampling import request_keys, request_seed

    layouts = {key: Layout(tuple(range(world_size)), s) for key, (_, s) in LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    preempted: list[int] = []
    original = RolloutEngine.run
    RolloutEngine.run = lambda self: original(self) if preempted.append(self) is None else None  # type: ignore
    from restage.rollout import pipelined as pipelined_rollout

    original_pipelined = pipelined_rollout.PipelinedRollout.run

    def pipelined(self):
        preempted.append(self.engine)
        return original_pipelined(self)

    pipelined_rollout.PipelinedRollout.run = pipelined  # type: ignore[method-assign]
    out = {}
    for key, (family, strategy) in LAYOUTS.items():
        module = load_stage(paths[family], layouts[key], groups, rank)
        pools = group_count(None, strategy.pp)
        # A check every step: under ep the replicas admit only at checks (lockstep), so requests start together.
        tight = RolloutLimits(max_slots=6, paged=True, check_every_steps=1,
                              kv_cache_bytes=BLOCKS_PER_POOL * pools * kv_bytes_per_slot(module, 16))
        for mode in ("greedy", "sampled"):
            for eos in (True, False):
                params = _params(mode, eos)
                runs = {}
                for name, limits in (("contiguous", RolloutLimits(max_slots=6, paged=False)),
                                     ("paged", RolloutLimits(max_slots=6, paged=True)), ("tight", tight)):
                    preempted.clear()
                    gen = generate(module, PROMPTS, params, group_size=GROUP, max_new_tokens=CAPS, limits=limits)
                    runs[name] = (gen.sequences(), gen.logprobs, gen.lengths, sum(e.preempted for e in preempted))
                out[(key, mode, eos, rank)] = runs
        if key == "dp2tp2":  # the graph-shaped step (what tp > 1 over NCCL captures) under tp over gloo, both caches
            params = _params("sampled", True)
            requests = len(PROMPTS) * GROUP
            for paged in (False, True):
                for decode_mode in ("eager", "static"):
                    engine = RolloutEngine(module, PROMPTS, [r // GROUP for r in range(requests)], CAPS,
                                           request_keys([request_seed(params.seed, r) for r in range(requests)]),
                                           params, list(EOS), RolloutLimits(max_slots=6, paged=paged),
                                           decode_mode=decode_mode)
                    out[("static", paged, decode_mode, rank)] = engine.run()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from restage.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("paged")
    paths = {family: str(build_tiny(root / family, family=family, seed=3)) for family in ("llama", "mixtral")}
    merged: dict = {}
    for result in spawn(_run, 4, paths, timeout_seconds=900):
        merged.update(result)
    return merged


@pytest.mark.parametrize("key", list(LAYOUTS))
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_paged_gives_the_contiguous_tokens_under_every_layout(results, key, mode):
    for eos in (True, False):
        for rank in range(4):
            runs = results[(key, mode, eos, rank)]
            expected, expected_logprobs, expected_lengths, none = runs["contiguous"]
            assert none == 0
            for name in ("paged", "tight"):
                tokens, logprobs, lengths, _ = runs[name]
                assert tokens == expected, (key, mode, eos, rank, name)
                torch.testing.assert_close(logprobs, expected_logprobs, rtol=0, atol=1e-5)
                assert torch.equal(lengths, expected_lengths)
            assert runs["paged"][3] == 0
        if not eos:  # every answer runs to its cap: a replica's pool of 3 blocks preempts on every layout
            assert all(results[(key, mode, eos, rank)]["tight"][3] >= 1 for rank in range(4)), [
                results[(key, mode, eos, rank)]["tight"][3] for rank in range(4)]
            assert results[(key, mode, eos, 0)]["tight"][2].tolist() == CAPS


def test_static_decode_steps_under_tp_give_the_eager_tokens_with_either_cache(results):
    for rank in range(4):
        eager = results[("static", False, "eager", rank)]
        for paged in (False, True):
            for decode_mode in ("eager", "static"):
                tokens, logprobs, lengths = results[("static", paged, decode_mode, rank)]
                assert torch.equal(tokens, eager[0]) and torch.equal(lengths, eager[2]), (rank, paged, decode_mode)
                torch.testing.assert_close(logprobs, eager[1], rtol=0, atol=1e-5)
        assert len(set(eager[2].tolist())) >= 4
