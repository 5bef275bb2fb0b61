"""The pipelined rollout's graph-shaped decode steps (``static``: what ``graphs`` captures on CUDA) on 4 gloo ranks.

Under pp=2 (dp=2) and tp=2 x pp=2, with 2 and 3 micro-groups, contiguous and paged caches, greedy and seeded
sampling, the ``static`` pipeline (each stage's step over its static buffers: hidden states received into its
group's rows, its output sent from them, the last stage's choice written into them) gives the eager pipeline's
tokens, lengths and log-probs; its steps run over several buckets of every micro-group, keyed (group start,
bound) as the graphs are; and the eager pipeline never goes through the static path.
"""

from __future__ import annotations

import pytest
import torch
from model_cases import ROLLOUT_EOS, rollout_params, sample_sequences

from restage.layout import Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

LAYOUTS = {"pp2": Strategy(dp=2, pp=2), "tp2pp2": Strategy(tp=2, pp=2)}
PROMPTS = sample_sequences([5, 11, 1, 8, 3, 11, 6], seed=7)
GROUP = 2
CAPS = [12, 3, 12, 7, 1, 12, 9, 12, 5, 12, 2, 10, 6, 12]  # per request (prompt i, sample j is request 2i + j)
# (pp_groups, paged) per layout: micro-groups of 3 and 2 slots out of 6, both caches
RUNS = {"pp2": ((None, False), (3, False), (None, True)), "tp2pp2": ((None, False), (None, True))}


def _run(rank, world_size, path):
    from restage.layout import Layout, ProcessGroups
    from restage.models.hf_checkpoint import load_stage
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.engine import RolloutEngine
    from restage.rollout.pipelined import PipelinedRollout
    from restage.rollout.sampling import request_keys, request_seed
    from restage.rollout.slots import slot_groups

    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    requests = len(PROMPTS) * GROUP
    out: dict = {}
    for key, layout in layouts.items():
        module = load_stage(path, layout, groups, rank)
        for mode in ("greedy", "sampled"):
            params = rollout_params(mode)
            for pp_groups, paged in RUNS[key]:
                for decode_mode in ("eager", "static"):
                    engine = RolloutEngine(module, PROMPTS, [r // GROUP for r in range(requests)], CAPS,
                                           request_keys([request_seed(params.seed, r) for r in range(requests)]),
                                           params, list(ROLLOUT_EOS), RolloutLimits(max_slots=6, check_every_steps=2,
                                                                            pp_groups=pp_groups, paged=paged),
                                           decode_mode=decode_mode)
                    steps: list[tuple[int, int]] = []
                    original = engine.graphs.run

                    def counted(bound, host, step, start=0, _original=original, _steps=steps):
                        _steps.append((start, bound))
                        _original(bound, host, step, start)

                    engine.graphs.run = counted  # type: ignore[method-assign]
                    runner = PipelinedRollout(engine)
                    tokens, logprobs, lengths = runner.run()
                    starts = [g.start for g in slot_groups(engine.num_slots, engine.num_groups)]
                    out[(key, mode, pp_groups, paged, decode_mode, rank)] = (
                        tokens.clone(), logprobs.clone(), lengths.clone(), steps, starts,
                        sum(1 for d in runner.log.decoded_slots if d), runner.buffers is not None)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from restage.models.tiny import build_tiny

    path = str(build_tiny(tmp_path_factory.mktemp("pp_graphs") / "llama", family="llama", seed=3))
    merged: dict = {}
    for result in spawn(_run, 4, path, timeout_seconds=600):
        merged.update(result)
    return merged


def _runs(results, mode):
    return [(key, pp_groups, paged, rank) for key, runs in RUNS.items() for pp_groups, paged in runs
            for rank in range(4) if (key, mode, pp_groups, paged, "eager", rank) in results]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_static_pipeline_gives_the_eager_tokens_and_logprobs(results, mode):
    runs = _runs(results, mode)
    assert len(runs) == 4 * (3 + 2)  # every rank of every layout and schedule returned
    reference = results[("pp2", mode, None, False, "eager", 0)]
    lengths = reference[2].tolist()
    assert len(set(lengths)) >= 4 and any(n < cap for n, cap in zip(lengths, CAPS))  # EOS and caps end answers
    for key, pp_groups, paged, rank in runs:
        eager = results[(key, mode, pp_groups, paged, "eager", rank)]
        static = results[(key, mode, pp_groups, paged, "static", rank)]
        where = (key, pp_groups, paged, rank)
        assert torch.equal(static[0], eager[0]), where
        assert torch.equal(static[2], eager[2]), where
        # the static step attends over every cache position, masked: the same softmax up to rounding
        torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5, msg=str(where))
        assert torch.equal(eager[0], reference[0]), where  # and every layout, schedule and cache agree
        assert static[5] == eager[5]  # the same decode events


def test_static_steps_cover_every_group_over_several_buckets(results):
    checked = 0
    bounds: dict[int, set[int]] = {}  # micro-groups -> the buckets their steps ran
    for (key, mode, pp_groups, paged, decode_mode, rank), value in results.items():
        steps, starts, decode_events, static_path = value[3], value[4], value[5], value[6]
        if decode_mode == "eager":
            assert steps == [] and not static_path  # the eager pipeline never stages through DecodeGraphs.run
            continue
        assert static_path and len(steps) == decode_events  # every decode event was one static step
        assert {start for start, _ in steps} == set(starts) and len(starts) == (pp_groups or 2)
        assert len(set(steps)) >= len(starts) + 1, (key, mode, pp_groups, paged, rank)  # some group changed bucket
        bounds.setdefault(pp_groups or 2, set()).update(bound for _, bound in steps)
        checked += 1
    assert checked == 2 * 4 * (3 + 2)
    assert bounds == {2: {1, 2, 3}, 3: {1, 2}}  # every bucket of groups of 3 and of 2 slots
