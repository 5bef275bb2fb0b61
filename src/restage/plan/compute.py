"""Seconds of one rank's compute for the pieces of a decoder: the roofline model and a measured profile.

Both models answer the same questions for one tensor-parallel shard on one device: the
forward / backward of one transformer block over ``batch`` sequences of ``seq`` tokens, one
decoding step of one block for ``batch`` sequences attending to ``ctx`` cached tokens, the
embedding and head over ``tokens`` tokens, and one optimizer step over a number of parameters.
Communication is not included; ``estimator.py`` adds it from the cluster's links.

The roofline takes, for each kernel, the larger of its FLOPs at the achievable FLOP/s and its
bytes at the achievable memory bandwidth, plus a fixed per-block overhead (kernel launches).
"""

from __future__ import annotations

from restage.cluster import ClusterSpec
from restage.models.config import ModelConfig
from restage.models.flops import attended_tokens, block_shape

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes an AdamW step moves per parameter: read param/master, grad, m, v; write master, m, v
# (mixed precision also writes the 16-bit copy).
ADAM_BYTES_PER_PARAM = {"fp32": 28, "bf16": 34, "fp16": 34}
# Elementwise traffic of one block per token, in hidden-size elements (norms, residuals, rotary,
# activation function), read and written.
_ELEMENTWISE_HIDDEN_PER_TOKEN = 12


class RooflineCompute:
    """Compute time from the cluster spec's peak figures (no measurement)."""

    source = "roofline"

    def __init__(self, cluster: ClusterSpec, cfg: ModelConfig, dtype: str):
        self.cluster, self.cfg, self.dtype = cluster, cfg, dtype
        self.bytes = DTYPE_BYTES[dtype]
        self.flops_per_second = cluster.achievable_flops_per_second(dtype)
        self.bytes_per_second = cluster.achievable_memory_bandwidth()

    def _kernel(self, flops: float, nbytes: float) -> float:
        return max(flops / self.flops_per_second, nbytes / self.bytes_per_second)

    def block_forward(self, batch: float, seq: int, tp: int) -> float:
        s = block_shape(self.cfg, tp)
        tokens = batch * seq
        matmul = self._kernel(2 * tokens * s.matmul_params, (s.weight_params + tokens * (s.hidden + s.inter)) * self.bytes)
        ctx = attended_tokens(seq, self.cfg.sliding_window)
        attention = self._kernel(4 * tokens * ctx * s.q_out, tokens * (2 * s.q_out + 2 * s.kv_out) * self.bytes)
        elementwise = tokens * _ELEMENTWISE_HIDDEN_PER_TOKEN * s.hidden * self.bytes / self.bytes_per_second
        return matmul + attention + elementwise + self.cluster.block_overhead_seconds

    def block_backward(self, batch: float, seq: int, tp: int) -> float:
        # Two matmuls per forward matmul (input and weight gradients), flash attention's backward
        # about 2.5x its forward; elementwise traffic doubles.
        s = block_shape(self.cfg, tp)
        tokens = batch * seq
        matmul = 2 * self._kernel(2 * tokens * s.matmul_params, (s.weight_params + tokens * (s.hidden + s.inter)) * self.bytes)
        ctx = attended_tokens(seq, self.cfg.sliding_window)
        attention = 2.5 * self._kernel(4 * tokens * ctx * s.q_out, tokens * (2 * s.q_out + 2 * s.kv_out) * self.bytes)
        elementwise = 2 * tokens * _ELEMENTWISE_HIDDEN_PER_TOKEN * s.hidden * self.bytes / self.bytes_per_second
        return matmul + attention + elementwise + 2 * self.cluster.block_overhead_seconds

    def block_prefill(self, batch: float, seq: int, tp: int) -> float:
        """A forward over the prompts that also writes the KV cache."""
        s = block_shape(self.cfg, tp)
        return self.block_forward(batch, seq, tp) + batch * seq * 2 * s.kv_out * self.bytes / self.bytes_per_second

    def decode_block(self, batch: float, ctx: float, tp: int) -> float:
        """One new token for each of ``batch`` sequences, attending to ``ctx`` cached tokens each."""
        s = block_shape(self.cfg, tp)
        ctx = min(ctx, self.cfg.sliding_window) if self.cfg.sliding_window else ctx
        matmul = self._kernel(2 * batch * s.matmul_params, s.weight_params * self.bytes)
        attention = self._kernel(4 * batch * ctx * s.q_out, batch * ctx * 2 * s.kv_out * self.bytes)
        return matmul + attention + self.cluster.block_overhead_seconds

    def embed_forward(self, tokens: float) -> float:
        return tokens * self.cfg.hidden_size * self.bytes * 2 / self.bytes_per_second

    def head_forward(self, tokens: float, tp: int) -> float:
        # Logits are kept in fp32 for the log-probabilities: written once, read by the softmax.
        s = block_shape(self.cfg, tp)
        return self._kernel(2 * tokens * s.hidden * s.head_out, s.head_out * s.hidden * self.bytes + tokens * s.head_out * 8)

    def head_backward(self, tokens: float, tp: int) -> float:
        return 2 * self.head_forward(tokens, tp)

    def optimizer_step(self, params: float) -> float:
        return params * ADAM_BYTES_PER_PARAM[self.dtype] / self.bytes_per_second


class ProfiledCompute:
    """Compute time interpolated from a measured profile; pieces the profile lacks fall back to the roofline.

    ``used`` records which source answered, so an estimate can say whether it came from a
    measurement, the roofline, or both.
    """

    def __init__(self, profile, roofline: RooflineCompute):
        self.profile, self.roofline = profile, roofline
        self.source = f"profile:{profile.name}"
        self.used: set[str] = set()

    def _ask(self, op: str, batch: float, seq: float, tp: int, fallback) -> float:
        seconds = self.profile.lookup(op, batch, seq, tp)
        if seconds is None:
            self.used.add("roofline")
            return fallback()
        self.used.add("profile")
        return seconds

    def block_forward(self, batch: float, seq: int, tp: int) -> float:
        return self._ask("block_forward", batch, seq, tp, lambda: self.roofline.block_forward(batch, seq, tp))

    def block_backward(self, batch: float, seq: int, tp: int) -> float:
        return self._ask("block_backward", batch, seq, tp, lambda: self.roofline.block_backward(batch, seq, tp))

    def block_prefill(self, batch: float, seq: int, tp: int) -> float:
        return self._ask("prefill", batch, seq, tp, lambda: self.roofline.block_prefill(batch, seq, tp))

    def decode_block(self, batch: float, ctx: float, tp: int) -> float:
        return self._ask("decode_step", batch, ctx, tp, lambda: self.roofline.decode_block(batch, ctx, tp))

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
        return per_param * params

    def describe(self) -> str:
        if self.used == {"profile"}:
            return self.source
        return f"{self.source}+roofline" if "profile" in self.used else "roofline"
