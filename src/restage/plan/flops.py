"""Model FLOPs of an MFC: the useful work, whatever the layout (recomputation is not counted).

Per token a forward costs 2 FLOPs per matrix parameter (blocks and head) plus causal
attention, 4 * attended keys * query width per block; a training pass is three forwards.
"""

from __future__ import annotations

from restage.graph import MFC
from restage.models.config import ModelConfig
from restage.plan.compute import attended_tokens, block_shape


def forward_flops(cfg: ModelConfig, tokens: float, attended: float, head_tokens: float | None = None) -> float:
    """FLOPs of a forward over ``tokens`` tokens attending to ``attended`` keys each on average."""
    s = block_shape(cfg, 1)
    head_tokens = tokens if head_tokens is None else head_tokens
    per_block = 2 * tokens * s.matmul_params + 4 * tokens * attended * s.q_out
    return cfg.num_layers * per_block + 2 * head_tokens * s.hidden * s.head_out


def mfc_flops(mfc: MFC, cfg: ModelConfig) -> float:
    """FLOPs of one MFC per iteration."""
    n = mfc.n_seqs
    if mfc.kind == "generate":
        prompt = forward_flops(cfg, n * mfc.prompt_tokens, attended_tokens(mfc.prompt_tokens, cfg.sliding_window),
                               head_tokens=n)
        ctx = mfc.prompt_tokens + (mfc.gen_tokens + 1) / 2
        if cfg.sliding_window:
            ctx = min(ctx, cfg.sliding_window)
        return prompt + forward_flops(cfg, n * mfc.gen_tokens, ctx)
    forward = forward_flops(cfg, n * mfc.seq_tokens, attended_tokens(mfc.seq_tokens, cfg.sliding_window))
    if mfc.kind == "inference":
        return forward
    return 3 * forward * mfc.epochs
