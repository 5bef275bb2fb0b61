"""Pipelined generation (micro-groups of slots in flight through the stages) on 4 real gloo ranks.

Under pp=2 and tp=2 x pp=2 it gives exactly the tokens of pp=1, greedy and sampled, with more
requests than slots, GRPO-style groups and answers ending at many lengths (EOS and per-request
caps); the sequential schedule (pp_groups=1) and more groups than stages (pp_groups=3) give them
too; a sampled request alone gives its tokens in the full batch; the log-probs equal a
teacher-forced forward under the same layout; and every stage saw the same schedule.
"""

from __future__ import annotations

import pytest
import torch
from model_cases import rollout_params, sample_sequences

from restage.layout import Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

LAYOUTS = {"pp1": Strategy(dp=4), "pp2": Strategy(dp=2, pp=2), "tp2pp2": Strategy(tp=2, pp=2)}
PROMPTS = sample_sequences([5, 11, 1, 8, 3, 11], seed=7)
GROUP = 2
CAPS = [12, 3, 12, 7, 1, 12, 9, 12, 5, 12, 2, 10]  # per request (prompt i, sample j is request 2i + j)
PP_GROUPS = {"pp1": (None,), "pp2": (None, 1, 3), "tp2pp2": (None, 1)}
ALONE = [0, 3, 7, 11]  # sampled requests also generated alone under pp=2


def _run(rank, world_size, path):
    from restage.layout import Layout, ProcessGroups
    from restage.models.hf_checkpoint import load_stage
    from restage.models.packing import pack
    from restage.models.pipeline import MicroBatch, pipeline_forward
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.generation import generate
    from restage.rollout.pipelined import PipelinedRollout
    from restage.rollout.sampling import request_seed

    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    out: dict = {"gen": {}, "alone": {}, "forced": {}, "ticks": {}}
    logs = []
    original = PipelinedRollout.run

    def logged(self):
        logs.append(self.log)
        return original(self)

    PipelinedRollout.run = logged  # type: ignore[method-assign]  # this process only: records each run's schedule
    for key, layout in layouts.items():
        module = load_stage(path, layout, groups, rank)
        ctx = module.ctx
        for mode in ("greedy", "sampled"):
            for pp_groups in PP_GROUPS[key]:
                logs.clear()
                limits = RolloutLimits(max_slots=4, check_every_steps=2, pp_groups=pp_groups)
                gen = generate(module, PROMPTS, rollout_params(mode), group_size=GROUP, max_new_tokens=CAPS, limits=limits)
                out["gen"][(key, mode, pp_groups, rank)] = (gen.sequences(), gen.logprobs, gen.lengths)
                if logs:
                    out["ticks"][(key, mode, pp_groups, rank)] = (ctx.pp_stage, logs[0].ticks, logs[0].decoded_slots)
            # Teacher-forced log-probs of the answers under this layout (the sampled ones at their temperature).
            params = rollout_params(mode)
            answers = out["gen"][(key, mode, None, rank)][0]
            sequences = [PROMPTS[r // GROUP] + a for r, a in enumerate(answers)]
            forced = pipeline_forward(module, [MicroBatch(*pack(sequences))], post_fn=lambda o, mb, m=module, p=params:
                                      m.token_logprobs(o, mb.tokens, mb.batch, temperature=1.0 if p.greedy else
                                                       p.temperature))
            if forced is not None and ctx.tp_rank == 0:
                out["forced"][(key, mode, rank)] = (forced[0], [len(s) for s in sequences])
        if key == "pp2":
            params = rollout_params("sampled")
            for r in ALONE:
                gen = generate(module, [PROMPTS[r // GROUP]], params, seeds=[request_seed(params.seed, r)],
                               max_new_tokens=[CAPS[r]])
                out["alone"][(r, rank)] = gen.sequences()[0]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from restage.models.tiny import build_tiny

    path = str(build_tiny(tmp_path_factory.mktemp("pipelined") / "llama", family="llama", seed=3))
    merged: dict = {"gen": {}, "alone": {}, "forced": {}, "ticks": {}}
    for result in spawn(_run, 4, path, timeout_seconds=600):
        for kind, values in result.items():
            merged[kind].update(values)
    return merged


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_layout_and_schedule_gives_the_pp1_tokens(results, mode):
    reference, ref_logprobs, ref_lengths = results["gen"][("pp1", mode, None, 0)]
    assert len(reference) == len(CAPS) and len(set(ref_lengths.tolist())) >= 4  # answers end at many lengths
    assert any(n < cap for n, cap in zip(ref_lengths.tolist(), CAPS))  # some at EOS, before their cap
    runs = [k for k in results["gen"] if k[1] == mode]
    assert len(runs) == 4 * (1 + 3 + 2)  # every rank of every layout and schedule returned
    for key in runs:
        sequences, logprobs, lengths = results["gen"][key]
        assert sequences == reference, key
        assert torch.equal(lengths, ref_lengths), key
        torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5, msg=str(key))


def test_a_sampled_request_alone_gives_its_tokens_in_the_full_batch(results):
    full = results["gen"][("pp2", "sampled", None, 0)][0]
    for (r, rank), alone in results["alone"].items():
        assert alone == full[r], (r, rank)
    assert len(results["alone"]) == len(ALONE) * 4


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_logprobs_equal_a_teacher_forced_forward_under_each_layout(results, mode):
    checked = 0
    for (key, m, rank), (forced, seq_lengths) in results["forced"].items():
        if m != mode:
            continue
        _, logprobs, lengths = results["gen"][(key, mode, None, rank)]
        start = 0
        for r, total in enumerate(seq_lengths):
            n, first = int(lengths[r]), start + len(PROMPTS[r // GROUP]) - 1
            assert (logprobs[r, :n] - forced[first:first + n]).abs().max().item() <= 1e-5, (key, r)
            start += total
            checked += 1
    assert checked == (4 + 2 + 1) * len(CAPS)  # the last stage's TP rank 0 of each replica: pp1 4, pp2 2, tp2pp2 1


def test_every_stage_runs_the_same_schedule_with_groups_interleaved(results):
    for (key, mode, pp_groups, _), (stage, ticks, decoded) in results["ticks"].items():
        groups = pp_groups or 2
        twin = [v for k, v in results["ticks"].items() if k[:3] == (key, mode, pp_groups) and v[0] != stage]
        assert twin and all(t[1] == ticks and t[2] == decoded for t in twin)  # the other stage: the same events
        # Slots 4 in `groups` groups: no event decodes more than one group's slots, and while every
        # request still waits or runs, consecutive events belong to different groups, all decoding.
        assert max(decoded) <= -(-4 // groups)
        assert all(d > 0 for d in decoded[:2 * groups])
