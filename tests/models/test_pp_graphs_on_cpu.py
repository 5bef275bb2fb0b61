"""Decode graphs under pipelined micro-groups (decode_graphs.py, pipelined.py) on one CPU process.

``choose_decode_mode`` picks graphs under pp > 1 only with micro-groups in flight; the pipelined schedule's
graph-shaped steps (``static``: each micro-group's step over its rows of the static buffers) give the eager
schedule's tokens with either cache, keep one address set per (group, bucket) and build no host tensor inside
the step; and with ``torch.cuda``'s graph calls replaced by recorders, ``graphs`` mode captures each (group,
bucket) once and replays the captured step (its arguments as captured) to the same tokens. The multirank test
(``test_pp_graphs_multirank.py``) runs the same steps over real stages.
"""

from __future__ import annotations

import pytest
import torch
from model_cases import sample_sequences

from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.rollout.budget import RolloutLimits
from restage.rollout.decode_graphs import choose_decode_mode
from restage.rollout.engine import RolloutEngine
from restage.rollout.pipelined import PipelinedRollout, StageBuffers
from restage.rollout.sampling import SamplingParams, request_keys, request_seed
from restage.rollout.slots import slot_groups

PROMPTS = sample_sequences([6, 1, 14, 9, 3, 11, 7], seed=5)
CAPS = [(r * 7) % 12 + 1 for r in range(len(PROMPTS) * 2)]
EOS = tuple(range(3, 40))
PARAMS = {"greedy": SamplingParams(max_new_tokens=12, greedy=True, eos_token_ids=EOS),
          "sampled": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, top_k=50, seed=3,
                                    eos_token_ids=EOS)}


@pytest.fixture(scope="module")
def llama(tiny_models):
    return load_stage(tiny_models["llama"], Layout((0,), Strategy()), None, 0)


def test_graphs_are_chosen_under_pp_only_with_micro_groups_in_flight():
    cuda = torch.device("cuda", 0)
    pp2 = dict(tp_size=1, pp_size=2, ep_size=1, sparse=False, micro_groups=2)
    assert choose_decode_mode(cuda, enabled=True, **pp2) == (
        "graphs", "one CUDA graph per micro-group and bucket on each stage (pp send/recv outside)")
    assert choose_decode_mode(cuda, enabled=True, **{**pp2, "tp_size": 2, "micro_groups": 3}) == (
        "graphs", "one CUDA graph per micro-group and bucket on each stage (pp send/recv outside) "
                  "(TP collectives captured)")
    assert choose_decode_mode(cuda, enabled=True, **{**pp2, "micro_groups": 1}) == (
        "eager", "pp > 1 with pp_groups=1 (each stage receives and sends inside its step)")
    assert choose_decode_mode(cuda, enabled=True, tp_size=1, pp_size=2, ep_size=1, sparse=False)[0] == "eager"
    for change in (dict(tp_size=2, tp_backend="gloo"), dict(ep_size=2), dict(sparse=True), dict(partitioned=True),
                   dict(enabled=False)):
        mode, reason = choose_decode_mode(cuda, **{"enabled": True, **pp2, **change})
        assert mode == "eager" and reason, change
    assert choose_decode_mode(torch.device("cpu"), enabled=True, **pp2) == ("eager", "cpu device")


def _engine(module, mode: str, decode_mode, pp_groups: int, paged: bool) -> RolloutEngine:
    params = PARAMS[mode]
    requests = len(PROMPTS) * 2
    return RolloutEngine(module, PROMPTS, [r // 2 for r in range(requests)], CAPS,
                         request_keys([request_seed(params.seed, r) for r in range(requests)]), params, list(EOS),
                         RolloutLimits(max_slots=6, check_every_steps=3, pp_groups=pp_groups, paged=paged),
                         decode_mode=decode_mode)


def _run(engine: RolloutEngine) -> tuple[tuple[torch.Tensor, ...], list[tuple[int, int]]]:
    steps: list[tuple[int, int]] = []
    original = engine.graphs.run

    def counted(bound, host, step, start=0):
        steps.append((start, bound))
        original(bound, host, step, start)

    engine.graphs.run = counted  # type: ignore[method-assign]
    return tuple(t.clone() for t in PipelinedRollout(engine).run()), steps


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_static_micro_groups_give_the_eager_tokens(llama, mode, paged):
    for pp_groups in (2, 3):
        eager, eager_steps = _run(_engine(llama, mode, "eager", pp_groups, paged))
        static, steps = _run(_engine(llama, mode, "static", pp_groups, paged))
        assert eager_steps == []  # the eager schedule is unchanged: no staging through DecodeGraphs.run
        assert torch.equal(static[0], eager[0]) and torch.equal(static[2], eager[2]), pp_groups
        torch.testing.assert_close(static[1], eager[1], rtol=0, atol=1e-5)  # attention over more masked keys
        starts = {g.start for g in slot_groups(6, pp_groups)}
        assert {start for start, _ in steps} == starts  # every group stepped over its own static rows
        assert len({bound for _, bound in steps}) >= 2 and len(set(steps)) > len(starts)  # several buckets
    lengths = eager[2].tolist()
    assert len(set(lengths)) >= 4 and any(n < c for n, c in zip(lengths, CAPS))  # EOS and caps end answers


def test_static_pipelined_steps_keep_their_addresses_per_group_and_bucket(llama, monkeypatch):
    per_key: dict[tuple[int, int], set] = {}
    built: list[int] = []
    step = StageBuffers.step

    def recorded(self, engine, start, bound, staged):
        per_key.setdefault((start, bound), set()).add(
            (staged.data_ptr(), engine.next_tokens[start:start + bound].data_ptr(),
             self.chosen[:, start:start + bound].data_ptr()))
        tensor = torch.tensor
        monkeypatch.setattr(torch, "tensor", lambda *a, **k: built.append(1) or tensor(*a, **k))
        try:
            step(self, engine, start, bound, staged)
        finally:
            monkeypatch.setattr(torch, "tensor", tensor)

    monkeypatch.setattr(StageBuffers, "step", recorded)
    _, steps = _run(_engine(llama, "sampled", "static", 2, True))
    assert set(per_key) == set(steps) and len(per_key) >= 3
    assert all(len(uses) == 1 for uses in per_key.values())  # one address set per (group, bucket)
    staging = {start: next(iter(uses))[0] for (start, _), uses in per_key.items()}
    assert len(set(staging.values())) == len(staging) == 2  # each group stages into its own columns
    assert built == []  # no tensor built on the host inside the step


def test_graphs_mode_captures_each_group_and_bucket_once_and_replays_the_captured_step(llama, monkeypatch):
    """The CUDA control flow with torch.cuda's stream and graph calls replaced by recorders: a capture records the
    step with its arguments (a real capture runs nothing), a replay runs that recorded step."""
    state: dict = {"capturing": None}
    captured: list[tuple[int, int]] = []
    replays = [0]

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        def __init__(self):
            self.recorded = None

        def replay(self):
            replays[0] += 1
            original_step(*self.recorded)

    class Capture:
        def __init__(self, graph, pool=None, stream=None, capture_error_mode="global"):
            self.graph = graph

        def __enter__(self):
            state["capturing"] = self.graph

        def __exit__(self, *exc):
            state["capturing"] = None

    class StreamContext:
        def __init__(self, stream):
            pass

        def __enter__(self):
            pass

        def __exit__(self, *exc):
            pass

    original_step = StageBuffers.step

    def step(self, engine, start, bound, staged):
        graph = state["capturing"]
        if graph is None:
            original_step(self, engine, start, bound, staged)
        else:  # recorded, not run
            graph.recorded = (self, engine, start, bound, staged)
            captured.append((start, bound))

    monkeypatch.setattr(StageBuffers, "step", step)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    for mode in ("greedy", "sampled"):
        captured.clear()
        replays[0] = 0
        static, _ = _run(_engine(llama, mode, "static", 3, False))
        engine = _engine(llama, mode, "graphs", 3, False)
        graphed, steps = _run(engine)
        assert sorted(captured) == sorted(set(steps)) == sorted(engine.graphs.graphs)  # one capture per key
        assert replays[0] == len(steps) - len(captured) > len(captured)  # most steps were replays
        assert all(torch.equal(a, b) for a, b in zip(static, graphed))
