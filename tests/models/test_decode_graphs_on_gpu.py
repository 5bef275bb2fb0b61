"""The rollout engine on a real GPU: CUDA-graph replay against the same steps run eagerly, and against transformers.

Skipped without CUDA (CI has none); run on a lent GPU machine with
``python -m pytest -q -m gpu tests/models/test_decode_graphs_on_gpu.py``. The ``static`` mode runs the very
step a graph captures, with the same shapes and buffers, as plain PyTorch, so a replayed graph must give its
tokens and log-probs bit for bit; ``eager`` attends over fewer (masked) cache positions, so its log-probs
may differ in the last bits while its greedy tokens stay the same.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from model_cases import PROMPTS, logprob_gap_to_teacher_forcing, sample_sequences

from restage.layout import Layout, Strategy
from restage.models.attention import Decode
from restage.models.hf_checkpoint import load_stage
from restage.models.packing import pack
from restage.models.tiny import load_hf
from restage.rollout import paged_cache
from restage.rollout.budget import RolloutLimits
from restage.rollout.decode_graphs import buckets
from restage.rollout.engine import RolloutEngine
from restage.rollout.generation import PartialRequest, continue_generate, generate
from restage.rollout.paged_cache import PagedKVCache
from restage.rollout.pipelined import run_pipelined
from restage.rollout.sampling import SamplingParams, request_keys, request_seed
from restage.rollout.slots import slot_groups

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a GPU machine)")]

ONE_RANK = Layout((0,), Strategy())
MANY = sample_sequences([6, 1, 14, 9, 3, 11, 7, 2, 12, 5], seed=11)
CAPS = [10, 3, 10, 7, 10, 1, 10, 10, 5, 10]  # per-request max lengths: slots free at different steps
SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=40, top_p=0.95, seed=3, eos_token_ids=(5, 17, 40))


def _stage(path: str, dtype: torch.dtype = torch.float32):
    return load_stage(path, ONE_RANK, None, 0, dtype=dtype, device=torch.device("cuda"))


def _engine(module, params: SamplingParams, mode, slots: int = 5, k: int = 3) -> RolloutEngine:
    requests = len(MANY) * 2
    return RolloutEngine(module, MANY, [r // 2 for r in range(requests)], [CAPS[r // 2] for r in range(requests)],
                         request_keys([request_seed(params.seed, r) for r in range(requests)]), params,
                         list(params.eos_token_ids or ()), RolloutLimits(max_slots=slots, check_every_steps=k),
                         decode_mode=mode)


# min_new_tokens holds EOS back inside the captured step (the first GPU run of a job with it set found a host copy there)
@pytest.mark.parametrize("params", [SAMPLED, dataclasses.replace(SAMPLED, min_new_tokens=4)], ids=["any", "min-new"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_replayed_graphs_equal_the_static_steps_bit_for_bit(tiny_models, name, dtype, params):
    module = _stage(tiny_models[name], dtype)
    static = _engine(module, params, "static")
    expected = static.run()
    graphed = _engine(module, params, "graphs")
    bounds: list[int] = []
    original = graphed.graphs.run
    graphed.graphs.run = lambda bound, host, step: bounds.append(bound) or original(bound, host, step)  # type: ignore[method-assign]
    got = graphed.run()
    assert set(graphed.graphs.graphs) == {(0, b) for b in bounds}  # one graph per bucket used, captured once
    assert set(bounds) <= set(buckets(graphed.num_slots)) and len(set(bounds)) >= 3
    assert len(bounds) > 2 * len(set(bounds))  # most steps were replays
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    assert len(set(got[2].tolist())) >= 3  # answers of several lengths: slots refilled, buckets changed


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama31"])
def test_greedy_graph_decoding_equals_transformers_on_cuda(tiny_models, name):
    path = tiny_models[name]
    module = _stage(path)
    params = SamplingParams(max_new_tokens=12, greedy=True, eos_token_ids=())
    out = generate(module, PROMPTS, params, limits=RolloutLimits(max_slots=3))
    hf = load_hf(path).cuda()
    expected = []
    for prompt in PROMPTS:
        ids = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=12, min_new_tokens=12,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
        expected.append(ids[0, len(prompt):].tolist())
    assert out.sequences() == expected


def test_sampled_request_under_graphs_is_the_same_alone_and_in_a_full_batch(tiny_models):
    module = _stage(tiny_models["llama"])
    group = 3
    seeds = [1000 + r for r in range(len(MANY) * group)]
    caps = [(r * 5) % 10 + 1 for r in range(len(seeds))]
    full = generate(module, MANY, SAMPLED, group_size=group, seeds=seeds, max_new_tokens=caps,
                    limits=RolloutLimits(max_slots=8))
    for r in (0, 4, 8, 17, 29):
        alone = generate(module, [MANY[r // group]], SAMPLED, seeds=[seeds[r]], max_new_tokens=[caps[r]])
        assert alone.sequences()[0] == full.sequences()[r]
        # One slot against eight: the graphs of other buckets run GEMMs of other shapes (last bits may differ).
        torch.testing.assert_close(alone.logprobs[0], full.logprobs[r], rtol=0, atol=1e-4)


def test_graph_logprobs_equal_a_teacher_forced_forward_on_cuda(tiny_models):
    module = _stage(tiny_models["llama"])
    out = generate(module, MANY, SAMPLED, group_size=2, limits=RolloutLimits(max_slots=5, check_every_steps=3))
    prompts = [p for p in MANY for _ in range(2)]
    assert logprob_gap_to_teacher_forcing(module, prompts, out, SAMPLED.temperature) <= 1e-4


def test_an_engine_and_its_graphs_free_their_memory(tiny_models):
    module = _stage(tiny_models["llama"])
    generate(module, MANY, SAMPLED)  # first use: kernels, cuBLAS workspace
    gc.collect()  # what the call above left for the collector (measured on an H200: 1,536 bytes) goes first
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = _engine(module, SAMPLED, "graphs")
    engine.run()
    assert engine.graphs.graphs and torch.cuda.memory_allocated() > before
    del engine
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_packed_forward_logits_equal_transformers_on_cuda(tiny_models, name):
    path = tiny_models[name]
    module = _stage(path)
    seqs = sample_sequences([7, 20, 13, 3], seed=1)
    tokens, batch = pack(seqs, device=torch.device("cuda"))
    hf = load_hf(path).cuda()
    with torch.no_grad():
        logits = module(tokens, batch)
        expected = torch.cat([hf(torch.tensor([s], device="cuda")).logits[0] for s in seqs])
    torch.testing.assert_close(logits.float(), expected, rtol=0, atol=1e-4)


def test_a_batch_continued_under_graphs_equals_its_uninterrupted_generation(tiny_models):
    """Partial rollouts on CUDA graphs: half the requests must finish while the other half start in the slots they
    free; those are cut, then continued in a second call (prompt + answer prefilled again): every answer equals
    the one uninterrupted graph generation gives it (fp32; the same noise per request)."""
    module = _stage(tiny_models["llama"])
    # Many EOS ids: answers end at spread lengths, so later requests take freed slots before the first half is done.
    params = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=50, seed=0, eos_token_ids=tuple(range(3, 257, 9)))
    prompts = MANY[:8]
    seeds = [5_000 + r for r in range(2 * len(prompts))]
    whole = generate(module, prompts, params, group_size=2, seeds=seeds)
    requests = [PartialRequest(tuple(prompts[r // 2]), seed) for r, seed in enumerate(seeds)]
    limits = RolloutLimits(max_slots=3, check_every_steps=2)
    half = len(requests) // 2
    first = continue_generate(module, requests, params, must_finish=half, limits=limits)
    answers = first.output.sequences()
    assert all(first.finished[:half]) and answers[:half] == whole.sequences()[:half]
    rows = [r for r in range(half, len(requests)) if not first.finished[r]]
    assert any(answers[r] for r in rows)  # some answers really were cut mid-way
    carried = [PartialRequest(requests[r].prompt, requests[r].seed, tuple(answers[r]),
                              tuple(first.output.token_logprobs()[r])) for r in rows]
    second = continue_generate(module, carried, params, must_finish=len(carried), limits=limits)
    assert all(second.finished)
    got = {r: answers[r] for r in range(half, len(requests)) if first.finished[r]}
    got.update(zip(rows, second.output.sequences()))
    assert [got[r] for r in range(half, len(requests))] == whole.sequences()[half:]


def test_paged_cache_replays_its_static_steps_and_equals_the_contiguous_cache(tiny_models):
    """The paged cache's decode step (the Triton kernel, or flash-attn's paged kernel in half precision with 256-token
    blocks) replays as a graph bit for bit, and gives the contiguous cache's tokens."""
    module = _stage(tiny_models["llama"])
    requests = len(MANY) * 2
    runs = {}
    for paged in (False, True):
        for mode in ("static", "graphs"):
            engine = RolloutEngine(module, MANY, [r // 2 for r in range(requests)],
                                   [CAPS[r // 2] for r in range(requests)],
                                   request_keys([request_seed(SAMPLED.seed, r) for r in range(requests)]), SAMPLED,
                                   list(SAMPLED.eos_token_ids or ()),
                                   RolloutLimits(max_slots=5, check_every_steps=3, paged=paged), decode_mode=mode)
            runs[(paged, mode)] = engine.run()
    for paged in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(runs[(paged, "static")], runs[(paged, "graphs")]))
    assert torch.equal(runs[(True, "graphs")][0], runs[(False, "graphs")][0])
    torch.testing.assert_close(runs[(True, "graphs")][1], runs[(False, "graphs")][1], rtol=0, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pipelined_micro_groups_replay_one_graph_per_group_and_bucket(tiny_models, dtype, paged):
    """The pipelined schedule (pipelined.py) with 2 and 3 micro-groups on one stage: graphs chosen by default, one
    captured per (group, bucket) used and replayed; bit for bit the ``static`` steps, and the eager tokens."""
    module = _stage(tiny_models["llama"], dtype)
    requests = len(MANY) * 2
    for pp_groups in (2, 3):
        runs, steps = {}, {}
        for mode in ("eager", "static", "graphs", None):
            engine = RolloutEngine(module, MANY, [r // 2 for r in range(requests)],
                                   [CAPS[r // 2] for r in range(requests)],
                                   request_keys([request_seed(SAMPLED.seed, r) for r in range(requests)]), SAMPLED,
                                   list(SAMPLED.eos_token_ids or ()),
                                   RolloutLimits(max_slots=6, check_every_steps=3, pp_groups=pp_groups, paged=paged),
                                   decode_mode=mode)
            used: list[tuple[int, int]] = []
            original = engine.graphs.run
            engine.graphs.run = (  # type: ignore[method-assign]
                lambda bound, host, step, start=0, _o=original, _u=used: _u.append((start, bound))
                or _o(bound, host, step, start))
            runs[mode], steps[mode] = run_pipelined(engine), used
            if mode == "graphs":
                assert set(engine.graphs.graphs) == set(used)  # one graph per (group, bucket) used, captured once
                assert {start for start, _ in used} == {g.start for g in slot_groups(engine.num_slots, pp_groups)}
                assert len(used) > 2 * len(set(used))  # most steps were replays
            if mode is None:
                assert engine.decode_mode == "graphs", engine.decode_reason
        assert steps["eager"] == [] and steps["static"] == steps["graphs"] == steps[None]
        for mode in ("graphs", None):
            assert all(torch.equal(a, b) for a, b in zip(runs["static"], runs[mode])), (pp_groups, mode)
        if dtype == torch.float32:  # eager attends over fewer (masked) positions: in bf16 a near tie may flip
            assert torch.equal(runs["graphs"][0], runs["eager"][0]) and torch.equal(runs["graphs"][2], runs["eager"][2])
            torch.testing.assert_close(runs["graphs"][1], runs["eager"][1], rtol=0, atol=1e-5)
        assert len(set(runs["graphs"][2].tolist())) >= 3  # answers of several lengths: slots refilled


def test_nccl_collectives_are_captured_in_a_cuda_graph_on_a_one_rank_group(tmp_path):
    """What tp > 1 decode graphs rely on (decode_graphs.choose_decode_mode): ProcessGroupNCCL's all-reduce,
    all-gather and broadcast captured with torch.cuda.graph and replayed over new inputs, on a 1-rank NCCL group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    group = dist.new_group([0], backend="nccl")
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    out = torch.empty(8, device="cuda")

    def step():
        y = x * 2
        dist.all_reduce(y, group=group)
        parts = [torch.empty_like(y)]
        dist.all_gather(parts, y, group=group)
        dist.broadcast(parts[0], src=0, group=group)
        out.copy_(parts[0] + 1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the warm-up: the communicator is made outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        step()
    for shift in (3.0, -1.0):
        x.add_(shift)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x * 2 + 1)


def _filled_cache(dtype: torch.dtype, rows: int = 4) -> tuple[PagedKVCache, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
    """A paged cache on the GPU (blocks of 16, GQA 4, head dim 64) whose rows hold 70, 33, 16 and 0 positions, the
    first two sharing two blocks; a step's q, k, v."""
    generator = torch.Generator(device="cuda").manual_seed(5)
    cache = PagedKVCache([0], rows=rows, max_len=96, block_tokens=16, num_blocks=20, kv_heads=2, head_dim=64,
                         dtype=dtype, device="cuda")
    cache.hold(0, 71)
    cache.hold(1, 34, share_from=0, shared_tokens=32)
    cache.hold(2, 17)
    cache.hold(3, 1)
    cache.flush()
    for pool in (cache.k[0], cache.v[0]):
        pool[:-1] = torch.randn(pool[:-1].shape, generator=generator, device="cuda", dtype=dtype)
    q, k, v = (torch.randn(rows, h, 64, generator=generator, device="cuda", dtype=dtype) for h in (8, 2, 2))
    return cache, q, k, v


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_the_triton_kernel_equals_the_gather_path_on_cuda(monkeypatch, dtype, atol, window):
    cache, q, k, v = _filled_cache(dtype)
    assert paged_cache.paged_kernel(q, cache.block_tokens) == "triton"  # blocks of 16: never flash-attn's
    lengths = [70, 33, 16, 0]
    triton = cache.decode_attention(0, Decode(torch.tensor(lengths, device="cuda"), 70), q, k, v, window)
    monkeypatch.setattr(paged_cache, "paged_kernel", lambda q, block_tokens: "gather")
    gathered = cache.decode_attention(0, Decode(torch.tensor(lengths, device="cuda"), 70), q, k, v, window)
    assert (triton.float() - gathered.float()).abs().max().item() < atol


def test_a_graph_replay_through_the_triton_kernel_equals_the_eager_step():
    cache, q, k, v = _filled_cache(torch.bfloat16)
    lengths = torch.tensor([70, 33, 16, 0], device="cuda")
    out = torch.empty_like(q)

    def step():
        out.copy_(cache.decode_attention(0, Decode(lengths, 95), q, k, v, None))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # the warm-up compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for new in ([71, 40, 5, 90], [3, 60, 17, 1]):  # other lengths than the capture's: read on the device
        lengths.copy_(torch.tensor(new))
        graph.replay()
        torch.cuda.synchronize()
        expected = cache.decode_attention(0, Decode(lengths.clone(), 95), q, k, v, None)
        assert torch.equal(out, expected)
