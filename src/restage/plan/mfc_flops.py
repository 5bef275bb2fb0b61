"""Model FLOPs of an MFC: the useful work, whatever the layout (recomputation is not counted).

A forward's FLOPs are ``models.flops.forward_flops``; a training pass is three forwards.
"""

from __future__ import annotations

from typing import assert_never

from restage.graph import MFC, MFCKind
from restage.models.arch import ModelConfig
from restage.models.flops import attended_tokens, forward_flops


def mfc_flops(mfc: MFC, cfg: ModelConfig) -> float:
    """FLOPs of one MFC per iteration."""
    n = mfc.n_seqs
    match mfc.kind:
        case MFCKind.GENERATE:
            prompt = forward_flops(cfg, n * mfc.prompt_tokens, attended_tokens(mfc.prompt_tokens, cfg.sliding_window),
                                   head_tokens=n)
            ctx = mfc.prompt_tokens + (mfc.gen_tokens + 1) / 2
            if cfg.sliding_window:
                ctx = min(ctx, cfg.sliding_window)
            return prompt + forward_flops(cfg, n * mfc.gen_tokens, ctx)
        case MFCKind.INFERENCE:
            return forward_flops(cfg, n * mfc.seq_tokens, attended_tokens(mfc.seq_tokens, cfg.sliding_window))
        case MFCKind.TRAIN_STEP:
            forward = forward_flops(cfg, n * mfc.seq_tokens, attended_tokens(mfc.seq_tokens, cfg.sliding_window))
            return 3 * forward * mfc.epochs
        case _:
            assert_never(mfc.kind)
