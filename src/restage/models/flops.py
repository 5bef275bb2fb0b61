"""FLOPs of a decoder's forward pass and the per-block shapes they come from (one tensor-parallel shard).

Per token a forward costs 2 FLOPs per matrix parameter (blocks and head) plus causal
attention, 4 * attended keys * query width per block. The planner's cost model and the
runtime's measured FLOP/s both count with these.

A mixture-of-experts block computes with its router and the ``k`` experts a token is sent to
only (``matmul_params``), but holds, and on a large batch reads, every expert
(``weight_params``); a ``BlockShape`` is the average over a model's dense and sparse blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from restage.models.arch import ModelConfig


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
    stored_inter: int = 0  # MLP width held (a mixture: all experts'); 0: ``inter``
    router: int = 0  # router outputs (experts) per block, averaged over blocks
    expert_params: int = 0  # of ``weight_params``, every expert's matrices (a mixture; averaged over blocks)

    @property
    def matmul_params(self) -> int:
        """Weight elements one token computes with (norms and biases are negligible; a mixture: the router and the
        token's ``k`` experts)."""
        attn = self.hidden * (2 * self.q_out + 2 * self.kv_out + self.router)
        return attn + (3 if self.gated else 2) * self.hidden * self.inter

    @property
    def weight_params(self) -> int:
        """Weight elements of the block's matrices (a mixture: every expert's)."""
        extra = (self.stored_inter - self.inter if self.stored_inter else 0) * (3 if self.gated else 2) * self.hidden
        return self.matmul_params + extra


@lru_cache(maxsize=512)
def block_shape(cfg: ModelConfig, tp: int = 1) -> BlockShape:
    """Shapes of one TP shard (heads, MLP width and vocabulary divided by ``tp``)."""
    hd = cfg.head_dim
    inter = stored = math.ceil(cfg.intermediate_size / tp)
    router = experts = 0
    if cfg.is_moe:  # averaged over the blocks: dense ones have ``intermediate_size``, sparse ones experts
        sparse, dense = len(cfg.sparse_layers), cfg.num_layers - len(cfg.sparse_layers)
        expert = math.ceil(cfg.moe_intermediate_size / tp)
        inter = round((dense * inter + sparse * cfg.experts_per_token * expert) / cfg.num_layers)
        stored = round((dense * stored + sparse * cfg.num_experts * expert) / cfg.num_layers)
        router = round(sparse * cfg.num_experts / cfg.num_layers)
        experts = round(sparse * cfg.num_experts * expert * (3 if cfg.traits.gated_mlp else 2) * cfg.hidden_size
                        / cfg.num_layers)
    return BlockShape(hidden=cfg.hidden_size, q_out=cfg.num_heads * hd // tp, kv_out=cfg.num_kv_heads * hd // tp,
                      inter=inter, vocab=math.ceil(cfg.vocab_size / tp),
                      head_out=1 if cfg.is_critic else math.ceil(cfg.vocab_size / tp), gated=cfg.traits.gated_mlp,
                      stored_inter=stored, router=router, expert_params=experts)


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
