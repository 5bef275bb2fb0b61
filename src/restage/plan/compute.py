"""Seconds of one rank's compute for the pieces of a decoder: the roofline model and a measured profile.

Both models answer the same questions for one tensor-parallel shard on one device: the
forward / backward of one transformer block over ``batch`` sequences of ``seq`` tokens, one
decoding step of one block for ``batch`` sequences attending to ``ctx`` cached tokens, the
embedding and head over ``tokens`` tokens, and one optimizer step over a number of parameters.
Communication is not included; ``estimator.py`` adds it from the cluster's links.

The roofline takes, for each kernel, the larger of its FLOPs at the achievable FLOP/s and its
bytes at the achievable memory bandwidth. GEMMs run at the efficiency their per-rank shape reaches
(``gemm.py``), attention at the cluster's ``attention_efficiency`` (flash attention). The host's time to
issue one block's kernels (``block_overhead_seconds``: Python, dispatcher, launches of an eager block)
runs ahead of the GPU asynchronously on a GPU cluster, spread over the block's ``KERNELS_PER_BLOCK``
kernels: each kernel takes the larger of its device time and its share of the host time, so small
decoding steps are launch-bound while a long attention still adds its time. On a CPU, where ops run
synchronously, the overhead adds; a CPU rank also computes and streams at its threads' speedup, and an op
whose largest tensor fits the cache streams at the cache's rate (``ClusterSpec.thread_speedup`` and
``stream_bandwidth``, measured by ``bench/cpu_rates.py``; GPU clusters leave both at memory's rate x 1). A CPU
GEMM of few rows runs below its square rate (``gemm_half_rows``, ``gemm.py``), and a CPU BLAS reads its weights
(``weight_read_bytes_per_second``) before computing, so the two times add there rather than overlap (both measured
by ``bench/cpu_rates.py``; ``block_overhead_seconds`` and ``compute_efficiency`` then fitted on measured block
profiles by ``bench/cpu_roofline_fit.py``).

A mixture's expert GEMMs: a block's tokens are spread over its experts, each expert multiplying
only the rows routed to it, so on a small batch the experts are memory-bound and only those some
token is routed to are read. With ``ep`` (expert parallelism) a rank holds ``1 / ep`` of the experts
and multiplies the rows its ep group routes to them: the same FLOPs per rank on balanced routing,
``1 / ep`` of the expert weights (``_weight_elements``). Routing imbalance is not modelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol, TypeVar

from restage.cluster import ClusterSpec
from restage.models.arch import ModelConfig
from restage.models.flops import BlockShape, attended_tokens, block_shape
from restage.plan.gemm import gemm_efficiency
from restage.plan.profile import Profile

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes an AdamW step moves per parameter: read param/master, grad, m, v; write master, m, v
# (mixed precision also writes the 16-bit copy).
ADAM_BYTES_PER_PARAM = {"fp32": 28, "bf16": 34, "fp16": 34}
# Elementwise traffic of one eager block per token, in elements of the model's dtype read and written,
# counted from models/decoder.py and models/rope.py: an RMSNorm upcasts to fp32, squares, averages, scales,
# casts back and multiplies by its weight (18 per hidden element; two norms); two residual adds (3 each);
# RoPE negates, concatenates, multiplies by cos and sin and adds (10 per q and k element); SiLU and the
# gate product (5 per MLP element). The backward moves about twice the forward's traffic.
# Counted for the LLaMA family; GPT-2 (fused LayerNorm, GELU) and mixtures are costed with the same count.
_NORM_ELEMENTS, _RESIDUAL_ELEMENTS, _ROPE_ELEMENTS, _MLP_ACT_ELEMENTS = 18, 3, 10, 5


def elementwise_elements_per_token(s: BlockShape, sequence_shards: int = 1) -> float:
    """Elements the forward's elementwise kernels of one block read and write per token (one TP rank).

    ``sequence_shards``: with sequence parallelism (Megatron's and torchtitan's TP, not restage's runtime) each TP rank
    runs the norms and residual adds on 1/tp of the tokens, so their hidden-wide elements count 1/tp per token."""
    return (2 * _NORM_ELEMENTS + 2 * _RESIDUAL_ELEMENTS) * s.hidden / sequence_shards \
        + _ROPE_ELEMENTS * (s.q_out + s.kv_out) + _MLP_ACT_ELEMENTS * s.inter
# Kernels one eager LLaMA block launches (counted in models/decoder.py: two RMSNorms of 8 ops, q/k/v/o and
# gate/up/down GEMMs (7), RoPE on q and k (12), KV-cache writes and attention (4), SiLU and product (2),
# two residual adds): 43, of which 7 GEMMs and 1 attention; the rest are elementwise.
KERNELS_PER_BLOCK = 43
GEMMS_PER_BLOCK = 7


def block_gemms(s: BlockShape) -> tuple[tuple[str, int, int], ...]:
    """The GEMMs of one block as the roofline costs them, per token row: (name, columns N, depth K) of a
    (rows x K) @ (K x N) product on one TP rank; q, k and v as one GEMM, gate and up as one, the router of a mixture."""
    gemms = (("qkv", s.q_out + 2 * s.kv_out, s.hidden), ("o", s.hidden, s.q_out),
             ("gate_up" if s.gated else "up", (2 if s.gated else 1) * s.inter, s.hidden), ("down", s.hidden, s.inter),
             ("router", s.router, s.hidden))
    return tuple(g for g in gemms if g[1])


class ComputeModel(Protocol):
    """What the estimator's cost functions ask a compute model (``RooflineCompute``, ``ProfiledCompute``): seconds
    of one rank's compute for the pieces of a decoder, and which sources answered since ``begin_estimate``."""

    def block_forward(self, batch: float, seq: int, tp: int, ep: int = 1) -> float: ...

    def block_backward(self, batch: float, seq: int, tp: int, ep: int = 1) -> float: ...

    def block_prefill(self, batch: float, seq: int, tp: int, ep: int = 1) -> float: ...

    def decode_block(self, batch: float, ctx: float, tp: int, ep: int = 1) -> float: ...

    def embed_forward(self, tokens: float) -> float: ...

    def head_forward(self, tokens: float, tp: int) -> float: ...

    def head_backward(self, tokens: float, tp: int) -> float: ...

    def optimizer_step(self, params: float) -> float: ...

    def begin_estimate(self) -> None:
        """Forget which sources answered: one estimate's ``describe`` names only its own."""

    def describe(self) -> str:
        """Which sources answered since ``begin_estimate``: ``roofline``, ``profile:<file>`` or both."""


class RooflineCompute:
    """Compute time from the cluster spec's peak figures (no measurement)."""

    source = "roofline"

    def __init__(self, cluster: ClusterSpec, cfg: ModelConfig, dtype: str, launch_overhead_seconds: float | None = None,
                 sequence_parallel: bool = False):
        """``launch_overhead_seconds``: host time per block call; default the cluster's ``block_overhead_seconds``
        (an engine with CUDA graphs passes about 0: ``engines.py``). ``sequence_parallel``: TP with sequence
        parallelism, as Megatron and torchtitan run it (``elementwise_elements_per_token``); restage's runtime does not."""
        self.cluster, self.cfg, self.dtype = cluster, cfg, dtype
        self.sequence_parallel = sequence_parallel
        self.bytes = DTYPE_BYTES[dtype]
        # A CPU rank's threads: its FLOP/s and streaming rate are one thread's times the speedup (1 on GPUs).
        self.peak_flops_per_second = cluster.peak_flops_per_second(dtype) * cluster.thread_speedup
        self.attention_flops_per_second = self.peak_flops_per_second * cluster.attention_efficiency
        # The two rates ``_stream`` picks from, read once (the cluster is frozen; the search asks millions of times).
        self.memory_bytes_per_second = cluster.stream_bandwidth(math.inf)
        self.cache_bytes_per_second = cluster.stream_bandwidth(0.0)  # memory's rate where no cache term applies
        self.launch_overhead_seconds = (cluster.block_overhead_seconds if launch_overhead_seconds is None
                                        else launch_overhead_seconds)
        self.weight_read_bytes_per_second = (0.0 if cluster.has_gpus
                                             else cluster.weight_read_bytes_per_second * cluster.thread_speedup)

    def _stream(self, nbytes: float, largest_elements: float) -> float:
        """Seconds an op takes to move ``nbytes`` when its largest tensor holds ``largest_elements`` of the model's
        dtype: at the cache's rate where that tensor fits the cache (CPU clusters), else at memory's."""
        fits = largest_elements * self.bytes <= self.cluster.cache_bytes
        return nbytes / (self.cache_bytes_per_second if fits else self.memory_bytes_per_second)

    def _elementwise(self, s: BlockShape, tp: int) -> float:
        return elementwise_elements_per_token(s, tp if self.sequence_parallel else 1)

    def _attention(self, flops: float, nbytes: float, largest_elements: float) -> float:
        return max(flops / self.attention_flops_per_second, self._stream(nbytes, largest_elements))

    def _matmuls(self, s: BlockShape, tokens: float, weights: float) -> float:
        """The block's GEMMs over ``tokens`` rows, each at the efficiency of its per-rank shape, or the bytes of
        the weights and activations they read, whichever takes longer."""
        gemms = block_gemms(s)
        flops_seconds = sum(2 * tokens * cols * depth / (self.peak_flops_per_second
                                                         * gemm_efficiency(self.cluster, tokens, cols, depth))
                            for _, cols, depth in gemms)
        if self.weight_read_bytes_per_second:  # a CPU BLAS packs the weights, then computes: the two add
            return flops_seconds + weights * self.bytes / self.weight_read_bytes_per_second
        largest = max(max(cols * depth for _, cols, depth in gemms), tokens * max(s.hidden, s.inter))
        return max(flops_seconds, self._stream((weights + tokens * (s.hidden + s.inter)) * self.bytes, largest))

    def block_matmuls(self, tokens: float, tp: int, ep: int = 1) -> float:
        """Device seconds of one block's GEMMs in a forward over ``tokens`` token rows on one TP rank (no launches)."""
        s = block_shape(self.cfg, tp)
        return self._matmuls(s, tokens, self._weight_elements(s, tokens, ep))

    def _with_launches(self, matmul: float, attention: float, elementwise: float, calls: int = 1) -> float:
        """A block's time from its kernels' device seconds: on a GPU each group of kernels takes the larger of its
        device time and its launches' host time (launches run ahead asynchronously); on a CPU the overhead adds."""
        if not self.cluster.has_gpus:
            return matmul + attention + elementwise + calls * self.launch_overhead_seconds
        per_kernel = calls * self.launch_overhead_seconds / KERNELS_PER_BLOCK
        return (max(matmul, GEMMS_PER_BLOCK * per_kernel) + max(attention, per_kernel)
                + max(elementwise, (KERNELS_PER_BLOCK - GEMMS_PER_BLOCK - 1) * per_kernel))

    def _weight_elements(self, s: BlockShape, tokens: float, ep: int) -> float:
        """Weight elements one block reads for ``tokens`` tokens on a rank: every dense matrix, and of the experts
        it holds (``1 / ep`` of them) those a token is routed to: with uniform top-k of E routing, an expert is
        chosen by none of the ``tokens * ep`` tokens its ep group routes with probability ``(1 - k/E) ** (tokens * ep)``."""
        if not s.expert_params:
            return s.weight_params
        cfg = self.cfg
        touched: float = 1 - (1 - cfg.experts_per_token / cfg.num_experts) ** (tokens * ep)
        return s.weight_params - s.expert_params + s.expert_params / ep * touched

    def block_forward(self, batch: float, seq: int, tp: int, ep: int = 1) -> float:
        s = block_shape(self.cfg, tp)
        tokens = batch * seq
        weights = self._weight_elements(s, tokens, ep)
        matmul = self._matmuls(s, tokens, weights)
        ctx = attended_tokens(seq, self.cfg.sliding_window)
        attention = self._attention(4 * tokens * ctx * s.q_out, tokens * (2 * s.q_out + 2 * s.kv_out) * self.bytes,
                                    tokens * s.q_out)
        elementwise = self._stream(tokens * self._elementwise(s, tp) * self.bytes, tokens * max(s.hidden, s.inter))
        return self._with_launches(matmul, attention, elementwise)

    def block_backward(self, batch: float, seq: int, tp: int, ep: int = 1) -> float:
        # Two matmuls per forward matmul (input and weight gradients), flash attention's backward
        # about 2.5x its forward; elementwise traffic doubles.
        s = block_shape(self.cfg, tp)
        tokens = batch * seq
        weights = self._weight_elements(s, tokens, ep)
        matmul = 2 * self._matmuls(s, tokens, weights)
        ctx = attended_tokens(seq, self.cfg.sliding_window)
        attention = 2.5 * self._attention(4 * tokens * ctx * s.q_out, tokens * (2 * s.q_out + 2 * s.kv_out) * self.bytes,
                                          tokens * s.q_out)
        elementwise = self._stream(2 * tokens * self._elementwise(s, tp) * self.bytes,
                                   tokens * max(s.hidden, s.inter))
        return self._with_launches(matmul, attention, elementwise, calls=2)

    def block_prefill(self, batch: float, seq: int, tp: int, ep: int = 1) -> float:
        """A forward over the prompts that also writes the KV cache."""
        s = block_shape(self.cfg, tp)
        return self.block_forward(batch, seq, tp, ep) + self._stream(batch * seq * 2 * s.kv_out * self.bytes,
                                                                     batch * seq * s.kv_out)

    def decode_block(self, batch: float, ctx: float, tp: int, ep: int = 1) -> float:
        """One new token for each of ``batch`` sequences, attending to ``ctx`` cached tokens each."""
        s = block_shape(self.cfg, tp)
        ctx = min(ctx, self.cfg.sliding_window) if self.cfg.sliding_window else ctx
        matmul = self._matmuls(s, batch, self._weight_elements(s, batch, ep))
        attention = self._attention(4 * batch * ctx * s.q_out, batch * ctx * 2 * s.kv_out * self.bytes,
                                    batch * ctx * s.kv_out)
        return self._with_launches(matmul, attention, 0.0)

    def embed_forward(self, tokens: float) -> float:
        return self._stream(tokens * self.cfg.hidden_size * self.bytes * 2, tokens * self.cfg.hidden_size)

    def head_forward(self, tokens: float, tp: int) -> float:
        # Logits are kept in fp32 for the log-probabilities: written once, read by the softmax.
        s = block_shape(self.cfg, tp)
        flops_seconds = 2 * tokens * s.hidden * s.head_out / (
            self.peak_flops_per_second * gemm_efficiency(self.cluster, tokens, s.head_out, s.hidden))
        logits_elements = tokens * s.head_out * 4 / self.bytes  # the fp32 logits, in elements of the model's dtype
        return max(flops_seconds, self._stream(s.head_out * s.hidden * self.bytes + tokens * s.head_out * 8,
                                               max(s.head_out * s.hidden, logits_elements)))

    def head_backward(self, tokens: float, tp: int) -> float:
        return 2 * self.head_forward(tokens, tp)

    def optimizer_step(self, params: float) -> float:
        # The flattened fp32 master copy is the largest tensor the step streams (4 bytes a parameter).
        return self._stream(params * ADAM_BYTES_PER_PARAM[self.dtype], params * 4 / self.bytes)

    def begin_estimate(self) -> None:
        """Nothing to forget: the roofline is its only source."""

    def describe(self) -> str:
        return self.source


def thread_scale(profile: Profile, cluster: ClusterSpec) -> float:
    """What a profile's seconds are multiplied by on ``cluster``'s ranks: on CPU ranks, the thread speedup of the threads
    the profile was measured with (``meta["threads"]``, 1 where unrecorded) over the rank's own
    (``ClusterSpec.thread_speedup``: each thread beyond the first adds ``thread_efficiency``); 1 on GPUs. Without it, a
    one-thread profile priced a two-thread rank's work at one thread's speed (the fresh held-out set's one-rank runs
    were 73-74% faster than so predicted, docs/cpu_check_2026-11-29_fresh_profiled.json)."""
    if cluster.has_gpus:
        return 1.0
    recorded = profile.meta.get("threads", 1)
    threads = max(int(recorded), 1) if isinstance(recorded, (int, float, str)) else 1
    return float((1.0 + (threads - 1) * cluster.thread_efficiency) / cluster.thread_speedup)


# A block op's second argument: a sequence length (forward, backward, prefill) or a cached context (decode).
_Seq = TypeVar("_Seq", int, float)


class ProfiledCompute:
    """Compute time interpolated from a measured profile; pieces the profile lacks fall back to the roofline.

    ``used`` records which source answered, so an estimate can say whether it came from a
    measurement, the roofline, or both. On a CPU rank a profile's seconds are scaled from the threads it was
    measured with (its ``meta["threads"]``) to the rank's, by the cluster's thread speedup (``thread_scale``).
    """

    def __init__(self, profile: Profile, roofline: RooflineCompute):
        self.profile, self.roofline = profile, roofline
        self.source = f"profile:{profile.name}"
        self.used: set[str] = set()
        self.scale = thread_scale(profile, roofline.cluster)

    def _ask(self, op: str, batch: float, seq: float, tp: int, fallback: Callable[[], float]) -> float:
        seconds = self.profile.lookup(op, batch, seq, tp)
        if seconds is None:
            self.used.add("roofline")
            return fallback()
        self.used.add("profile")
        return seconds * self.scale

    def _block(self, op: str, batch: float, seq: _Seq, tp: int, ep: int,
               roofline: Callable[[float, _Seq, int, int], float]) -> float:
        """A block op from the profile (measured without ep); under ep scaled by the roofline's ratio of the two."""
        seconds = self._ask(op, batch, seq, tp, lambda: roofline(batch, seq, tp, 1))
        return seconds if ep == 1 else seconds * roofline(batch, seq, tp, ep) / roofline(batch, seq, tp, 1)

    def block_forward(self, batch: float, seq: int, tp: int, ep: int = 1) -> float:
        return self._block("block_forward", batch, seq, tp, ep, self.roofline.block_forward)

    def block_backward(self, batch: float, seq: int, tp: int, ep: int = 1) -> float:
        return self._block("block_backward", batch, seq, tp, ep, self.roofline.block_backward)

    def block_prefill(self, batch: float, seq: int, tp: int, ep: int = 1) -> float:
        return self._block("prefill", batch, seq, tp, ep, self.roofline.block_prefill)

    def decode_block(self, batch: float, ctx: float, tp: int, ep: int = 1) -> float:
        return self._block("decode_step", batch, ctx, tp, ep, self.roofline.decode_block)

    def embed_forward(self, tokens: float) -> float:
        return self._ask("embed_forward", tokens, 1, 1, lambda: self.roofline.embed_forward(tokens))

    def _head_measured(self) -> bool:
        return self.profile.arch.is_critic == self.roofline.cfg.is_critic

    def head_forward(self, tokens: float, tp: int) -> float:
        if not self._head_measured():
            self.used.add("roofline")
            return self.roofline.head_forward(tokens, tp)
        return self._ask("head_forward", tokens, 1, tp, lambda: self.roofline.head_forward(tokens, tp))

    def head_backward(self, tokens: float, tp: int) -> float:
        if not self._head_measured():
            self.used.add("roofline")
            return self.roofline.head_backward(tokens, tp)
        return self._ask("head_backward", tokens, 1, tp, lambda: self.roofline.head_backward(tokens, tp))

    def optimizer_step(self, params: float) -> float:
        per_param = self.profile.lookup("optimizer_step_per_param", 1, 1, 1)
        if per_param is None:
            self.used.add("roofline")
            return self.roofline.optimizer_step(params)
        self.used.add("profile")
        return per_param * params * self.scale

    def begin_estimate(self) -> None:
        self.used.clear()

    def describe(self) -> str:
        if self.used == {"profile"}:
            return self.source
        return f"{self.source}+roofline" if "profile" in self.used else "roofline"
