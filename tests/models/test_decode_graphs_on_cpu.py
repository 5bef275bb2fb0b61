"""Decode steps over static buffers (decode_graphs.py): the buckets, padding and staging a CUDA graph replays.

The ``static`` mode runs on CPU exactly what ``graphs`` mode captures on CUDA (same step function, same
buffers, one shape per bucket); its tokens must equal the eager engine's.
"""

from __future__ import annotations

import pytest
import torch
from model_cases import PROMPTS, sample_sequences

from restage.config.load import build
from restage.config.sections import GenerationConfig
from restage.errors import ConfigError
from restage.layout import Layout, Strategy
from restage.models import attention
from restage.models.decoder import StageModule
from restage.models.hf_checkpoint import load_stage
from restage.rollout.budget import RolloutLimits
from restage.rollout.decode_graphs import DecodeGraphs, buckets, choose_decode_mode, stage_inputs
from restage.rollout.engine import RolloutEngine
from restage.rollout.sampling import SamplingParams, request_keys, request_seed
from restage.rollout.slots import bucket as _bucket

ONE_RANK = Layout((0,), Strategy())
MANY = sample_sequences([6, 1, 14, 9, 3, 11, 7, 2, 12, 5], seed=11)
CAPS = [10, 3, 10, 7, 10, 1, 10, 10, 5, 10]  # per-request max lengths: slots free at different steps


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], ONE_RANK, None, 0)


def test_buckets_are_the_bounds_the_engine_uses():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(8) == [1, 2, 4, 8]
    assert buckets(0) == []
    for slots in range(1, 20):
        assert {_bucket(n, slots) for n in range(1, slots + 1)} == set(buckets(slots))


def test_stage_inputs_pad_free_slots_into_the_spare_row():
    lengths, steps, requests = [5, 0, 7, 3, 9], [2, 0, 4, 1, 6], [0, None, 3, 2, 4]
    host = stage_inputs(lengths, steps, requests, bound=4, spare_row=10)
    assert host.dtype == torch.int64
    assert host.tolist() == [[5, 0, 7, 3], [2, 0, 4, 1], [0, 10, 3, 2]]
    # A free slot keeps its recorded length (0 once retired) but never its stale step.
    assert stage_inputs([4, 8], [3, 5], [None, 1], bound=2, spare_row=7).tolist() == [[4, 8], [0, 5], [7, 1]]


def test_run_copies_into_one_static_buffer_and_steps_over_its_view():
    seen: list[tuple[int, int, list[list[int]]]] = []
    graphs = DecodeGraphs(8, torch.device("cpu"), "static")
    graphs.staged.fill_(-1)

    def step(bound, staged):
        seen.append((bound, staged.data_ptr(), staged.tolist()))

    graphs.run(2, torch.tensor([[3, 4], [0, 1], [5, 6]]), step)
    graphs.run(4, torch.tensor([[1, 2, 3, 4], [0, 0, 0, 0], [9, 9, 9, 9]]), step)
    assert [s[0] for s in seen] == [2, 4]
    assert seen[0][2] == [[3, 4], [0, 1], [5, 6]]
    assert {s[1] for s in seen} == {graphs.staged.data_ptr()}  # the same addresses a graph replays
    assert graphs.staged[:, 4:].eq(-1).all()  # slots past the bucket untouched
    assert graphs.fixed_span and not DecodeGraphs(2, torch.device("cpu"), "eager").fixed_span


def test_graphs_are_chosen_for_one_stage_dense_cuda_ranks_with_nccl_tp():
    single = dict(tp_size=1, pp_size=1, ep_size=1, sparse=False)
    assert choose_decode_mode(torch.device("cuda", 0), enabled=True, **single)[0] == "graphs"
    assert choose_decode_mode(torch.device("cuda", 0), enabled=True, **{**single, "tp_size": 4}) == (
        "graphs", "one CUDA graph per batch bucket (TP collectives captured)")
    assert choose_decode_mode(torch.device("cpu"), enabled=True, **single) == ("eager", "cpu device")
    assert choose_decode_mode(torch.device("cuda"), enabled=False, **single)[0] == "eager"
    for change in (dict(tp_size=2, tp_backend="gloo"), dict(pp_size=2), dict(ep_size=2), dict(sparse=True),
                   dict(partitioned=True)):
        mode, reason = choose_decode_mode(torch.device("cuda"), enabled=True, **{**single, **change})
        assert mode == "eager" and reason


def test_the_engine_picks_eager_on_cpu_and_its_config_switch_exists(llama):
    params = SamplingParams(max_new_tokens=4, greedy=True)
    assert params.cuda_graphs is True  # generation.cuda_graphs: on by default, used on CUDA only
    assert build(GenerationConfig, {"cuda_graphs": False}).cuda_graphs is False
    with pytest.raises(ConfigError, match="generation.cuda_graphs"):
        build(GenerationConfig, {"cuda_graphs": "maybe"}, "generation")
    engine = RolloutEngine(llama, PROMPTS, [0, 1], [4, 4], request_keys([0, 1]), params, [], RolloutLimits())
    assert (engine.decode_mode, engine.decode_reason) == ("eager", "cpu device")


def _run(module: StageModule, params: SamplingParams, mode, slots: int, k: int):
    requests = len(MANY) * 2
    engine = RolloutEngine(module, MANY, [r // 2 for r in range(requests)], [CAPS[r // 2] for r in range(requests)],
                           request_keys([request_seed(params.seed, r) for r in range(requests)]), params,
                           [] if params.eos_token_ids is None else list(params.eos_token_ids),
                           RolloutLimits(max_slots=slots, check_every_steps=k), decode_mode=mode)
    bounds: list[int] = []
    original = engine.graphs.run
    engine.graphs.run = lambda bound, host, step: bounds.append(bound) or original(bound, host, step)  # type: ignore[method-assign]
    tokens, logprobs, lengths = engine.run()
    return tokens, logprobs, lengths, bounds


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_static_steps_give_the_eager_tokens_across_bucket_changes(llama, greedy):
    eos = (int(MANY[0][0]),) if greedy else (5, 17, 40)  # a stop set so answers end early and slots refill
    params = SamplingParams(max_new_tokens=10, greedy=greedy, temperature=0.8, top_k=40, top_p=0.95, seed=3,
                            eos_token_ids=eos)
    eager = _run(llama, params, "eager", slots=5, k=3)
    static = _run(llama, params, "static", slots=5, k=3)
    assert eager[3] == static[3]  # the same bucket sequence
    assert {5, 4, 2} <= set(static[3])  # 20 requests through 5 slots: refills, then the tail shrinks the bucket
    assert torch.equal(eager[0], static[0]) and torch.equal(eager[2], static[2])
    torch.testing.assert_close(eager[1], static[1], rtol=0, atol=1e-5)  # attention over more masked keys
    assert len(set(static[2].tolist())) >= 3  # answers of several lengths (caps and stops)


def test_static_steps_keep_their_shapes_and_addresses_per_bucket(llama, monkeypatch):
    """Per bucket: every decode forward reads the same addresses with the same shapes, and builds no host tensor."""
    per_bucket: dict[int, set] = {}
    key_lengths: set[int] = set()
    original_forward = StageModule.forward
    original_sdpa = attention.F.scaled_dot_product_attention

    def forward(self, inputs, batch, cache=None, select=None, routing=None, *, attn=None):
        if isinstance(attn, attention.Decode):
            bound = inputs.shape[0]
            per_bucket.setdefault(bound, set()).add((inputs.data_ptr(), batch.positions.data_ptr(),
                                                     attn.lengths.data_ptr(), attn.longest))
        return original_forward(self, inputs, batch, cache, select, routing, attn=attn)

    in_step = [False]

    def sdpa(q, k, v, **kwargs):
        if in_step[0]:
            key_lengths.add(k.shape[2])
        return original_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(StageModule, "forward", forward)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    built: list[int] = []
    step = RolloutEngine._decode_step

    def counted_step(self, bound, staged):
        tensor = torch.tensor
        monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(1) or tensor(*a, **k))
        in_step[0] = True
        try:
            step(self, bound, staged)
        finally:
            monkeypatch.setattr(torch, "tensor", tensor)
            in_step[0] = False

    monkeypatch.setattr(RolloutEngine, "_decode_step", counted_step)
    params = SamplingParams(max_new_tokens=10, temperature=0.8, seed=3, eos_token_ids=(5, 17, 40))
    *_, bounds = _run(llama, params, "static", slots=5, k=3)
    max_len = max(len(MANY[r // 2]) + CAPS[r // 2] for r in range(len(MANY) * 2))
    assert set(per_bucket) == set(bounds) and len(per_bucket) >= 2
    assert all(len(uses) == 1 for uses in per_bucket.values())  # one address set per bucket
    assert {use[3] for uses in per_bucket.values() for use in uses} == {max_len - 1}
    assert key_lengths == {max_len}  # attention over the whole cache: no shape follows the lengths
    assert built == []  # no tensor built on the host inside the step


def test_graphs_mode_warms_up_captures_once_per_bucket_then_replays(monkeypatch):
    """The CUDA control flow with torch.cuda's graph API replaced by recorders (no GPU here)."""
    log: list[tuple] = []
    state = {"stream": "main", "capturing": None}

    class Stream:
        def __init__(self, name="side"):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait", self.name, other.name))

    class Graph:
        def __init__(self):
            self.captured = None

        def replay(self):
            bound, staged = self.captured
            log.append(("replay", bound, staged.tolist()))

    class StreamContext:
        def __init__(self, stream):
            self.stream, self.before = stream, None

        def __enter__(self):
            self.before, state["stream"] = state["stream"], self.stream.name

        def __exit__(self, *exc):
            state["stream"] = self.before

    class Capture:
        def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
            self.graph = graph
            log.append(("capture", pool, capture_error_mode))

        def __enter__(self):
            state["capturing"] = self.graph

        def __exit__(self, *exc):
            state["capturing"] = None

    def step(bound, staged):
        graph = state["capturing"]
        if graph is not None:  # recorded, not run
            graph.captured = (bound, staged)
        else:
            log.append(("run", bound, state["stream"], staged.tolist()))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("main"))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool-1")
    graphs = DecodeGraphs(8, torch.device("cpu"), "graphs")
    assert graphs.fixed_span
    host = {4: [[7, 8, 0, 3], [1, 2, 0, 0], [0, 1, 9, 2]], 2: [[9, 10], [3, 4], [0, 1]]}
    # (bound, shift, start): a pipelined micro-group's slots start at 4; its buckets are graphs of their own
    for bound, shift, start in ((4, 0, 0), (4, 1, 0), (2, 0, 4), (4, 2, 0), (2, 5, 4), (2, 6, 0)):
        graphs.run(bound, torch.tensor(host[bound]) + shift, step, start=start)
    shifted = {(bound, shift): (torch.tensor(host[bound]) + shift).tolist() for bound in host for shift in range(7)}
    assert log == [
        ("wait", "side", "main"), ("run", 4, "side", shifted[4, 0]), ("wait", "main", "side"),  # warm-up
        ("capture", "pool-1", "thread_local"),
        ("replay", 4, shifted[4, 1]),
        ("wait", "side", "main"), ("run", 2, "side", shifted[2, 0]), ("wait", "main", "side"),
        ("capture", "pool-1", "thread_local"),  # the same pool for every bucket
        ("replay", 4, shifted[4, 2]),
        ("replay", 2, shifted[2, 5]),  # the group at 4 replays its own bucket-2 graph ...
        ("wait", "side", "main"), ("run", 2, "side", shifted[2, 6]), ("wait", "main", "side"),
        ("capture", "pool-1", "thread_local"),  # ... and bucket 2 from slot 0 is captured anew
    ]
    assert sorted(graphs.graphs) == [(0, 2), (0, 4), (4, 2)]
    assert graphs.staged[:, 4:6].tolist() == shifted[2, 5] and graphs.staged[:, :2].tolist() == shifted[2, 6]


def test_an_engine_is_freed_without_a_garbage_collection(llama):
    """Nothing the engine owns points back at it: its KV cache goes when generate drops it."""
    import gc
    import weakref

    engine = RolloutEngine(llama, PROMPTS, [0, 1], [3, 3], request_keys([0, 1]), SamplingParams(max_new_tokens=3),
                           [], RolloutLimits(), decode_mode="static")
    engine.run()
    gc.disable()
    try:
        ref = weakref.ref(engine)
        del engine
        assert ref() is None
    finally:
        gc.enable()
