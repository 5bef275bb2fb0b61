"""Decode steps over static buffers: eager, or captured as one CUDA graph per batch-size bucket and replayed.

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
  The graphs of all buckets share one memory pool (``torch.cuda.graph_pool_handle``): a step's
  intermediates die inside its graph and its results go to the engine's buffers (allocated before
  any capture), so buckets may replay in any order over the same pool memory.

Under tp > 1 over NCCL the step's TP collectives (the row-parallel all-reduces, the logits' all-gather and
the sampler's broadcast) are captured in the graph (NCCL >= 2.9.6 supports capture; ProcessGroupNCCL keeps
work made during a capture out of its watchdog): every TP rank runs the same steps over the same buckets, so
their warm-ups, captures and replays pair up, and the warm-up's collectives create the communicator before
any capture. A TP group over gloo (CPU) never captures. Graphs stay off under pp (stages hand activations on
with send/recv driven by the host, between and across ticks) and with mixtures of experts (the
tokens-per-expert counts are read on the host); those layouts stay eager (same results, same buffers).
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
                       sparse: bool, partitioned: bool = False, tp_backend: str = "nccl") -> tuple[DecodeMode, str]:
    """``graphs`` where CUDA graphs serve this decode, else ``eager``; and why, in a few words.

    ``partitioned``: the module's parameters are ZeRO-3 partitions (a model generating in its training
    layout), which DeepSpeed's forward hooks gather with collectives and host-side bookkeeping each forward.
    ``tp_backend``: the TP group's backend under tp > 1 (only NCCL's collectives can be captured).
    """
    if device.type != "cuda":
        return "eager", f"{device.type} device"
    if not enabled:
        return "eager", "generation.cuda_graphs is off"
    if partitioned:
        return "eager", "ZeRO-3 partitioned parameters (DeepSpeed gathers them in each forward)"
    if pp_size > 1:
        return "eager", "pp > 1 (stages exchange activations with host-driven send/recv)"
    if tp_size > 1 and tp_backend != "nccl":
        return "eager", f"tp > 1 over {tp_backend} (only NCCL collectives are captured)"
    if ep_size > 1 or sparse:
        return "eager", "mixture of experts (tokens per expert are read on the host)"
    return "graphs", "one CUDA graph per batch bucket" + (" (TP collectives captured)" if tp_size > 1 else "")


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
    """The staging buffer and, in ``graphs`` mode, the captured graph of each bucket; ``run`` does one step."""

    def __init__(self, slots: int, device: torch.device, mode: DecodeMode):
        self.mode, self.device = mode, device
        self.staged = torch.zeros(3, slots, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.captures, self.fixed_span = mode_traits(mode)
        self.pool = torch.cuda.graph_pool_handle() if self.captures else None  # one memory pool for every bucket

    @torch.no_grad()  # inference only: a capture must record no autograd state
    def run(self, bound: int, host: torch.Tensor, step: StepFn) -> None:
        """Copy ``host`` (``stage_inputs``) into the staging buffer and run ``step`` over ``bound`` slots.

        ``step`` is passed per call, not kept: the engine owning this object owns the step, and a
        reference back would keep the engine (and its KV cache) alive until a garbage collection.
        """
        staged = self.staged[:, :bound]
        staged.copy_(host, non_blocking=True)  # before the step, on the stream it runs on
        if not self.captures:
            step(bound, staged)
        elif bound in self.graphs:
            self.graphs[bound].replay()
        else:
            self.graphs[bound] = self._warm_up_and_capture(bound, staged, step)

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
