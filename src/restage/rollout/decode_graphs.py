"""Decode steps over static buffers: eager, or captured as one CUDA graph per bucket (and micro-group) and replayed.

A decode step of the rollout engine (``engine.py``) runs over the first ``bound`` cache slots,
``bound`` a bucket: a power of two, or the slot count (``buckets``). Everything the step reads
lives in buffers allocated once per engine (the KV cache, the slots' next tokens, alive flags and
noise keys, the output rows) plus one staging buffer, ``[3, slots]`` int64: each slot's cache
length (its position), its answer step and its output row. The host builds those three rows for
the bucket (``stage_inputs``: free slots of the bucket get position 0, step 0 and the spare output
row) and copies them into the staging buffer before the step, so the step itself makes no host to
device copy, reads no value back and has the same shapes every time its bucket runs.

Three modes (``choose_decode_mode``):

* ``eager``: the step runs as plain PyTorch; SDPA attends over the longest filled prefix. CPU, and
  every layout graphs do not cover.
* ``static``: eager too, but with the shapes a graph needs (SDPA attends over all ``max_len`` cache
  positions, masked). The CPU tests run it to check the buffers, padding and buckets a graph
  replays give the eager tokens.
* ``graphs`` (CUDA, ``generation.cuda_graphs``): a bucket's first step is the warm-up, run eagerly
  on a side stream (lazy initialisation, cuBLAS workspaces and flash-attn's kernel selection happen
  outside capture), then the same step is captured with ``torch.cuda.graph`` into a
  ``torch.cuda.CUDAGraph``; later steps of that bucket copy their staging rows in and ``replay()``.
  The graphs of all buckets (and micro-groups) share one memory pool (``torch.cuda.graph_pool_handle``):
  a step's intermediates die inside its graph and its results go to the engine's buffers (allocated
  before any capture), so buckets may replay in any order over the same pool memory.

Under tp > 1 over NCCL the step's TP collectives (the row-parallel all-reduces, the logits' all-gather and
the sampler's broadcast) are captured in the graph (NCCL >= 2.9.6 supports capture; ProcessGroupNCCL keeps
work made during a capture out of its watchdog): every TP rank runs the same steps over the same buckets, so
their warm-ups, captures and replays pair up, and the warm-up's collectives create the communicator before
any capture. A TP group over gloo (CPU) never captures.

Under pp > 1 with micro-groups in flight (``pipelined.py``, ``pp_groups`` unset or >= pp) each stage captures
its own part of a decode step, one graph per (micro-group, bucket): the key is ``(start, bound)``, ``start`` the
group's first slot, since every group has its own rows in the static buffers (the staging buffer's columns, the
KV cache rows, and ``pipelined.StageBuffers``: the hidden states received in, the stage's output to send on,
the last stage's chosen tokens and log-probs). What is captured: the stage's layers (and its TP collectives), on
the first stage the embedding, on the last the LM head, the sampler and the TP broadcast of its choice. What
stays outside, issued by the host in the tick schedule's order: the send/recv of hidden states between
stages, the per-tick broadcast of the chosen tokens over the pp group, the recording of those tokens, and the
prefill. Why the sends are not captured (the issue asked for them in the graph):
a stage's output of tick ``t`` goes out at tick ``t + 1``, in one grouped send/recv with the next event's
input, after that tick's broadcast of tokens over the pp group; the receiver posts its matching receive in its
own tick ``t + 1``, also after that broadcast. Captured at the end of tick ``t``'s graph, the send would be
queued on the stream before this stage's broadcast of tick ``t + 1``, while the next stage's receive is
queued after its own: on NCCL's blocking send/recv each stage's stream would wait on the other's (a cycle
through the broadcast), unless the message happened to fit NCCL's buffers. Capturing the receive alone
would save one launch, and the eager prefill's hidden states (their count changes with every admission)
travel in the same grouped exchange. Kept outside, a tick adds one grouped p2p and one broadcast to the
graph's replay, against the hundreds of kernel launches the graph removes. ``pp_groups=1`` (stages one after
another, a stage's receive and send inside the step itself, ``engine._stage_step``) stays eager, and so do
mixtures of experts (the tokens-per-expert counts are read on the host) and ZeRO-3 partitioned modules;
those layouts run the same steps without graphs (same results, same buffers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, assert_never

import torch

DecodeMode = Literal["eager", "static", "graphs"]
StepFn = Callable[[int, torch.Tensor], None]  # (bound, staged [3, bound] view of the static buffer) -> None


def buckets(slots: int) -> list[int]:
    """The decode bounds an engine of ``slots`` slots can use: powers of two below it, then ``slots``."""
    sizes = [1 << i for i in range(max(slots, 1).bit_length()) if 1 << i < slots]
    return sizes + [slots] if slots else []


def stage_inputs(lengths: Sequence[int], steps: Sequence[int], requests: Sequence[int | None], bound: int,
                 spare_row: int) -> torch.Tensor:
    """``[3, bound]`` int64 host rows (position, answer step, output row) of slots ``0 .. bound-1``.

    A free slot (``requests[i]`` None) decodes into its own unused cache row at its recorded length
    (0 once retired), with step 0 and the output's spare row, so it writes nothing anyone reads.
    """
    return torch.tensor([list(lengths[:bound]),
                         [s if r is not None else 0 for s, r in zip(steps[:bound], requests[:bound])],
                         [r if r is not None else spare_row for r in requests[:bound]]], dtype=torch.int64)


def choose_decode_mode(device: torch.device, *, enabled: bool, tp_size: int, pp_size: int, ep_size: int,
                       sparse: bool, partitioned: bool = False, tp_backend: str = "nccl",
                       micro_groups: int = 1) -> tuple[DecodeMode, str]:
    """``graphs`` where CUDA graphs serve this decode, else ``eager``; and why, in a few words.

    ``partitioned``: the module's parameters are ZeRO-3 partitions (a model generating in its training
    layout), which DeepSpeed's forward hooks gather with collectives and host-side bookkeeping each forward.
    ``tp_backend``: the TP group's backend under tp > 1 (only NCCL's collectives can be captured).
    ``micro_groups``: the engine's micro-groups of slots in flight (``budget.group_count``); under pp > 1 only
    the pipelined schedule (more than one) hands activations on outside the step, so only it is captured.
    """
    if device.type != "cuda":
        return "eager", f"{device.type} device"
    if not enabled:
        return "eager", "generation.cuda_graphs is off"
    if partitioned:
        return "eager", "ZeRO-3 partitioned parameters (DeepSpeed gathers them in each forward)"
    if pp_size > 1 and micro_groups == 1:
        return "eager", "pp > 1 with pp_groups=1 (each stage receives and sends inside its step)"
    if tp_size > 1 and tp_backend != "nccl":
        return "eager", f"tp > 1 over {tp_backend} (only NCCL collectives are captured)"
    if ep_size > 1 or sparse:
        return "eager", "mixture of experts (tokens per expert are read on the host)"
    reason = "one CUDA graph per batch bucket"
    if micro_groups > 1:
        reason = "one CUDA graph per micro-group and bucket on each stage (pp send/recv outside)"
    return "graphs", reason + (" (TP collectives captured)" if tp_size > 1 else "")


def mode_traits(mode: DecodeMode) -> tuple[bool, bool]:
    """(captures: steps are captured as CUDA graphs and replayed, fixed_span: attention covers every cache
    position, one shape per bucket as a graph needs) of ``mode``."""
    match mode:
        case "graphs":
            return True, True
        case "static":
            return False, True
        case "eager":
            return False, False
        case _:
            assert_never(mode)


class DecodeGraphs:
    """The staging buffer and, in ``graphs`` mode, the captured graph of each ``(start, bound)``: a bucket of the
    slots from ``start`` (0, or a pipelined micro-group's first slot); ``run`` does one step."""

    def __init__(self, slots: int, device: torch.device, mode: DecodeMode):
        self.mode, self.device = mode, device
        self.staged = torch.zeros(3, slots, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (start, bound) -> its graph
        self.captures, self.fixed_span = mode_traits(mode)
        self.pool = torch.cuda.graph_pool_handle() if self.captures else None  # one memory pool for every bucket

    @torch.no_grad()  # inference only: a capture must record no autograd state
    def run(self, bound: int, host: torch.Tensor, step: StepFn, start: int = 0) -> None:
        """Copy ``host`` (``stage_inputs``) into the staging buffer's columns ``start ..`` and run ``step`` over
        ``bound`` slots from ``start``.

        ``step`` is passed per call, not kept: the engine owning this object owns the step, and a
        reference back would keep the engine (and its KV cache) alive until a garbage collection.
        """
        staged = self.staged[:, start:start + bound]
        staged.copy_(host, non_blocking=True)  # before the step, on the stream it runs on
        key = (start, bound)
        if not self.captures:
            step(bound, staged)
        elif key in self.graphs:
            self.graphs[key].replay()
        else:
            self.graphs[key] = self._warm_up_and_capture(bound, staged, step)

    def _warm_up_and_capture(self, bound: int, staged: torch.Tensor, step: StepFn) -> torch.cuda.CUDAGraph:
        """Run this step eagerly on a side stream (the warm-up), then capture it for the next ones."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch declares no types on Stream.__new__
        side.wait_stream(current)  # the staging copy
        with torch.cuda.stream(side):
            step(bound, staged)  # this step's real work: capture below records without running
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads of the process (NCCL's watchdog, reward workers) may touch CUDA
        # meanwhile; only this thread's calls must be capture-safe.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step(bound, staged)
        return graph
