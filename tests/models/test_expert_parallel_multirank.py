"""Expert parallelism on 4 real gloo ranks, one launch: a tiny Mixtral and Qwen3-MoE under dp4ep2, dp4ep4, dp2ep2tp2
and dp2ep2pp2 against transformers (logits, greedy generation with replicas that hold different prompts, none, or
finish early), 1F1B gradients under dp2ep2pp2 against one rank, and reallocation between ep, tp and pp layouts
of the model (bit-exact, bytes equal to the lower bound)."""

from __future__ import annotations

import pytest
import torch
from model_cases import MICRO_BATCHES, PROMPTS, hf_greedy, hf_outputs, sample_sequences

from restage.layout import Layout, Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

MOE = {"mixtral": dict(family="mixtral"), "qwen3_moe": dict(family="qwen3_moe", head_dim=24)}
LAYOUTS = {"dp4ep2": Strategy(dp=4, ep=2), "dp4ep4": Strategy(dp=4, ep=4), "dp2ep2tp2": Strategy(dp=2, tp=2, ep=2),
           "dp2ep2pp2": Strategy(dp=2, pp=2, ep=2)}
NEW_TOKENS = 16
# What replica d generates: all prompts; one prompt that stops early at an EOS; nothing; one prompt.
EARLY = 1  # index in PROMPTS of the prompt that stops early
# Each replica forwards its own micro-batches (the same number on every replica of an ep group).
FORWARD = {0: MICRO_BATCHES, 1: MICRO_BATCHES[::-1], 2: MICRO_BATCHES, 3: MICRO_BATCHES[::-1]}
TRAIN = {d: [sample_sequences(lengths, seed=20 + 2 * d + i) for i, lengths in enumerate(([9, 4], [3, 6, 5]))]
         for d in range(2)}
REALLOC = [("dp2ep2", (0, 1), Strategy(dp=2, ep=2), (2, 3), Strategy(tp=2)),
           ("dp2ep2 -> pp2 same ranks", (0, 1), Strategy(dp=2, ep=2), (0, 1), Strategy(pp=2)),
           ("dp4ep2 -> dp2tp2", (0, 1, 2, 3), Strategy(dp=4, ep=2), (0, 1, 2, 3), Strategy(dp=2, tp=2)),
           ("dp2ep2pp2 -> dp4ep4", (0, 1, 2, 3), Strategy(dp=2, pp=2, ep=2), (3, 2, 1, 0), Strategy(dp=4, ep=4)),
           ("tp2pp2 -> dp2ep2tp2", (0, 1, 2, 3), Strategy(tp=2, pp=2), (0, 1, 2, 3), Strategy(dp=2, tp=2, ep=2))]


def replica_prompts(dp_index: int, early_eos: int) -> tuple[list[list[int]], tuple[int, ...]]:
    return [(PROMPTS, ()), ([PROMPTS[EARLY]], (early_eos,)), ([], ()), ([PROMPTS[3]], ())][dp_index]


def _loss(module, n_micro_batches: int):
    def loss_fn(output, mb):
        logprobs = module.token_logprobs(output, mb.tokens, mb.batch)
        entropy = module.token_entropy(output)
        return (-logprobs.mean() - 0.01 * entropy.mean()) / n_micro_batches

    return loss_fn


def _micro_batches(seqs_list):
    from restage.models.packing import pack
    from restage.models.pipeline import MicroBatch

    return [MicroBatch(*pack(seqs)) for seqs in seqs_list]


def _run(rank, world_size, paths, early_eos):
    from restage.layout import ProcessGroups
    from restage.models.arch import ModelConfig
    from restage.models.expert_parallel import average_gradients
    from restage.models.hf_checkpoint import load_stage
    from restage.models.parallel import gather_from_tp, vocab_sizes
    from restage.models.pipeline import pipeline_forward, train_1f1b
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.generation import generate
    from restage.rollout.sampling import SamplingParams
    from restage.runtime.dataplane.realloc import execute_reallocation, groups_for
    from restage.schedule.realloc_plan import plan_reallocation

    cfg = ModelConfig.from_pretrained(paths["mixtral"])
    plans = [(plan_reallocation(cfg, Layout(a, sa), Layout(b, sb), bytes_per_element=4),
              plan_reallocation(cfg, Layout(b, sb), Layout(a, sa), bytes_per_element=4)) for _, a, sa, b, sb in REALLOC]
    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in LAYOUTS.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()]
                           + groups_for(*(p for pair in plans for p in pair)))
    out = {"logits": {}, "generated": {}, "queued": {}, "grads": {}, "losses": {}, "realloc": {}}
    for (key, layout), name in ((kv, name) for kv in layouts.items() for name in MOE):
        module = load_stage(paths[name], layout, groups, rank)
        ctx = module.ctx
        mine = _micro_batches(FORWARD[ctx.dp_rank])
        logits = pipeline_forward(module, mine, post_fn=lambda o, mb, m=module: gather_from_tp(
            o, m.ctx, vocab_sizes(m.cfg.vocab_size, m.ctx)))
        if logits is not None and ctx.tp_rank == 0:
            out["logits"][(name, key, rank)] = (ctx.dp_rank, torch.cat(logits))
        prompts, eos = replica_prompts(ctx.dp_rank, early_eos[name])
        gen = generate(module, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True, eos_token_ids=eos))
        out["generated"][(name, key, rank)] = (ctx.dp_rank, gen.sequences())
        if name == "mixtral" and key in ("dp4ep2", "dp2ep2pp2"):  # a queue longer than the slots, in lockstep
            queued = generate(module, prompts, SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True, eos_token_ids=eos),
                              group_size=2, limits=RolloutLimits(max_slots=1, check_every_steps=3))
            out["queued"][(key, rank)] = (gen.sequences(), queued.sequences())
        if key == "dp2ep2pp2" and name == "mixtral":
            mbs = _micro_batches(TRAIN[ctx.dp_rank])
            losses = train_1f1b(module, mbs, _loss(module, len(mbs)), aux_scale=1 / len(mbs))
            average_gradients(module, ctx)
            out["grads"][rank] = {n: p.grad.clone() for n, p in module.named_parameters()}
            out["losses"][rank] = (ctx.dp_rank, losses)
    full = {name: torch.randn(spec.shape, generator=torch.Generator().manual_seed(i))
            for i, (name, spec) in enumerate((s.name, s) for s in _param_specs(cfg))}
    for (what, a, sa, b, sb), (forward, backward) in zip(REALLOC, plans):
        src, dst = Layout(a, sa), Layout(b, sb)
        original = _shard_of(cfg, src, rank, full)
        there = execute_reallocation(forward, original or None, groups, dtype=torch.float32)
        back = execute_reallocation(backward, there.state or None, groups, dtype=torch.float32)
        exact = (_same(there.state, _shard_of(cfg, dst, rank, full)) and _same(back.state, original))
        out["realloc"][(what, rank)] = (exact, there.stats.received_bytes + back.stats.received_bytes,
                                        forward.lower_bound_bytes + backward.lower_bound_bytes,
                                        forward.total_bytes + backward.total_bytes)
    return out


def _param_specs(cfg):
    from restage.models.sharding import param_specs

    return param_specs(cfg)


def _shard_of(cfg, layout, rank, full):
    from restage.models.sharding import coord_shard_specs

    coord = layout.coord(rank)
    if coord is None:
        return {}
    return {s.param.name: full[s.param.name][s.index()].clone() for s in coord_shard_specs(cfg, layout.strategy, coord)}


def _same(got, expected) -> bool:
    return got.keys() == expected.keys() and all(torch.equal(got[n], t) for n, t in expected.items())


@pytest.fixture(scope="module")
def moe_paths(tmp_path_factory):
    from restage.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("moe")
    return {name: str(build_tiny(root / name, seed=5 + i, **kwargs)) for i, (name, kwargs) in enumerate(MOE.items())}


@pytest.fixture(scope="module")
def moe_path(moe_paths):
    return moe_paths["mixtral"]


@pytest.fixture(scope="module")
def reference(moe_paths):
    out = {}
    for name, path in moe_paths.items():
        greedy = hf_greedy(path, PROMPTS, NEW_TOKENS)
        out[name] = {"greedy": greedy, "early_eos": greedy[EARLY][4]}
    return out


@pytest.fixture(scope="module")
def results(moe_paths, reference):
    merged: dict = {}
    early_eos = {name: ref["early_eos"] for name, ref in reference.items()}
    for result in spawn(_run, 4, moe_paths, early_eos, timeout_seconds=600):
        for kind, values in result.items():
            merged.setdefault(kind, {}).update(values)
    return merged


@pytest.mark.parametrize("name", list(MOE))
def test_logits_equal_transformers_under_every_ep_layout(results, moe_paths, name):
    expected = {}
    for d, mbs in FORWARD.items():
        expected[d] = torch.cat(hf_outputs(moe_paths[name], [s for mb in mbs for s in mb]))
    seen = set()
    for (model, key, rank), (dp_index, logits) in results["logits"].items():
        if model != name:
            continue
        diff = (logits - expected[dp_index]).abs().max().item()
        assert diff <= 1e-4, f"{name} {key} rank {rank}: max |logit diff| {diff:.2e}"
        seen.add(key)
        print(f"ep logits {name} {key} rank {rank}: max |diff| {diff:.2e}")
    assert seen == set(LAYOUTS)


@pytest.mark.parametrize("name", list(MOE))
def test_greedy_generation_is_token_identical_with_replicas_that_finish_early_or_hold_nothing(results, reference, name):
    greedy, eos = reference[name]["greedy"], reference[name]["early_eos"]
    early = greedy[EARLY][: greedy[EARLY].index(eos) + 1]
    assert len(early) < NEW_TOKENS  # that replica really finishes before its peers
    expected = {0: greedy, 1: [early], 2: [], 3: [greedy[3]]}
    runs = {(key, rank): v for (model, key, rank), v in results["generated"].items() if model == name}
    assert {key for key, _ in runs} == set(LAYOUTS)
    for (key, rank), (dp_index, sequences) in runs.items():
        assert sequences == expected[dp_index], f"{name} {key} rank {rank} (replica {dp_index})"


def test_a_queue_longer_than_the_slots_decodes_in_lockstep_under_ep(results):
    """One slot per replica, two greedy samples per prompt: each sample is the replica's single-slot answer."""
    assert len(results["queued"]) == 8
    for alone, queued in results["queued"].values():
        assert queued == [answer for answer in alone for _ in range(2)]


def test_1f1b_gradients_under_dp2_ep2_pp2_equal_one_rank(results, moe_path):
    from restage.layout import Layout
    from restage.models.arch import ModelConfig
    from restage.models.hf_checkpoint import load_stage
    from restage.models.pipeline import train_1f1b
    from restage.models.sharding import coord_shard_specs

    module = load_stage(moe_path, Layout((0,), Strategy()), None, 0)
    mbs = _micro_batches(TRAIN[0] + TRAIN[1])
    ref_losses = train_1f1b(module, mbs, _loss(module, len(mbs)), aux_scale=1 / len(mbs))
    ref = {n: p.grad for n, p in module.named_parameters()}
    cfg = ModelConfig.from_pretrained(moe_path)
    layout = Layout(tuple(range(4)), LAYOUTS["dp2ep2pp2"])
    worst = 0.0
    for rank, grads in results["grads"].items():
        coord = layout.coord(rank)
        shards = {s.param.name: s for s in coord_shard_specs(cfg, layout.strategy, coord)}
        assert grads.keys() == shards.keys()
        assert any(".experts." in n for n in grads) and len(grads) < len(ref)
        for name, grad in grads.items():
            expected = ref[name][shards[name].index()]
            error = ((grad - expected).norm() / expected.norm()).item()
            worst = max(worst, error)
            assert error <= 1e-5, f"rank {rank} {name}: relative error {error:.2e}"
    assert worst <= 1e-5
    print(f"ep2 pp2 1F1B gradients: worst relative error {worst:.2e}")
    for dp_index, losses in results["losses"].values():
        if losses is not None:  # the last stage: each replica's losses, scaled by its 2 micro-batches
            got = torch.stack(losses) / 2  # a replica scales by 1/2, the single rank by 1/4
            assert torch.allclose(got, torch.stack(ref_losses[2 * dp_index: 2 * dp_index + 2]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("what", [r[0] for r in REALLOC])
def test_reallocation_between_ep_tp_pp_layouts_is_exact_at_the_lower_bound(results, what):
    rows = [v for (w, _), v in results["realloc"].items() if w == what]
    assert len(rows) == 4 and all(exact for exact, *_ in rows)
    received = sum(r[1] for r in rows)
    lower_bound, planned = rows[0][2], rows[0][3]
    assert received == planned == lower_bound > 0
    print(f"realloc {what}: {received} bytes received, lower bound {lower_bound}")
