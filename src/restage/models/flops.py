"""FLOPs of a decoder's forward pass and the per-block shapes they come from (one tensor-parallel shard).

Per token a forward costs 2 FLOPs per matrix parameter (blocks and head) plus causal
attention, 4 * attended keys * query width per block. The planner's cost model and the
runtime's measured FLOP/s both count with these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from restage.models.config import ModelConfig


@dataclass(frozen=True)
class BlockShape:
    """Per-block sizes of a decoder that the cost models need, for one TP degree."""

    hidden: int
    q_out: int
    kv_out: int
    inter: int
    vocab: int
    head_out: int  # vocab for an LM head, 1 for a scalar head
    gated: bool  # SwiGLU (three MLP matrices) or plain MLP (two)

    @property
    def matmul_params(self) -> int:
        """Weight elements of the block's matrices (norms and biases are negligible)."""
        attn = self.hidden * (2 * self.q_out + 2 * self.kv_out)
        return attn + (3 if self.gated else 2) * self.hidden * self.inter


@lru_cache(maxsize=512)
def block_shape(cfg: ModelConfig, tp: int = 1) -> BlockShape:
    """Shapes of one TP shard (heads, MLP width and vocabulary divided by ``tp``)."""
    hd = cfg.head_dim
    return BlockShape(hidden=cfg.hidden_size, q_out=cfg.num_heads * hd // tp, kv_out=cfg.num_kv_heads * hd // tp,
                      inter=math.ceil(cfg.intermediate_size / tp), vocab=math.ceil(cfg.vocab_size / tp),
                      head_out=1 if cfg.is_critic else math.ceil(cfg.vocab_size / tp), gated=cfg.family != "gpt2")


def attended_tokens(seq: int, window: int | None) -> float:
    """Average keys a query attends to in a causal sequence of ``seq`` tokens."""
    full = (seq + 1) / 2
    return min(full, window) if window else full


def forward_flops(cfg: ModelConfig, tokens: float, attended: float, head_tokens: float | None = None) -> float:
    """FLOPs of a forward over ``tokens`` tokens attending to ``attended`` keys each on average."""
    s = block_shape(cfg, 1)
    head_tokens = tokens if head_tokens is None else head_tokens
    per_block = 2 * tokens * s.matmul_params + 4 * tokens * attended * s.q_out
    return cfg.num_layers * per_block + 2 * head_tokens * s.hidden * s.head_out
