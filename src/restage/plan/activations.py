"""What restage's decoder saves for its backward pass, in bytes per token: the activations a training step holds.

Counted tensor by tensor from ``models/decoder.py``, ``attention.py`` and ``rope.py`` (each storage once, parameters
and views of them not at all) and checked exactly against ``torch.autograd.graph.saved_tensors_hooks`` around a real
block forward (``tests/plan/test_activation_memory_on_cpu.py``). ``e`` is the model's bytes per element; RMSNorm
keeps its fp32 input and statistic whatever the model's dtype.

Per block, one TP shard (``block_shape``: ``hidden``, ``q_out``, ``kv_out``, ``inter``; ``heads`` / ``kv_heads``
this rank's):

* each of the two norms: RMSNorm (LLaMA family) its fp32 input ``4 hidden``, the fp32 ``rsqrt`` of the mean
  square ``4``, the normalised value scaled by the weight ``e hidden`` and its output, the matmuls' input,
  ``e hidden``; LayerNorm (GPT-2) its input and output ``2 e hidden`` and the mean and reciprocal deviation,
  ``2 x 4`` (fp32 on CUDA; a CPU keeps them in the model's dtype, ``e`` each);
* Qwen3's head norms (``qk_norm``), on the q and on the k heads: fp32 input ``4 width``, ``4`` per head,
  normalised ``e width``;
* attention on the SDPA path (``attention._sdpa_by_length``): the index of the tokens gathered per length, int64
  ``8``; SDPA's gathered ``q``, ``k``, ``v`` (``(q_out + 2 kv_out) e``), its output ``q_out e`` and fp32
  log-sum-exp ``4 heads``; the output projection's input, a fresh buffer ``q_out e``. RoPE keeps only its tables
  (per forward, below): the rotated product's other factor is the tables, and the pre-RoPE ``q``/``k`` are kept
  only by Qwen3's head norms (as their normalised value);
* the MLP: SwiGLU the gate's output, SiLU's output, the up projection's output and their product (the down
  projection's input), ``4 inter e``; GPT-2 the up projection's output and GELU's output, ``2 inter e``.

Per forward (once per pipeline stage and micro-batch, not per block): the embedding's int64 ids ``8`` and RoPE's
``cos`` and signed ``sin`` tables, ``2 head_dim e`` per token (the LLaMA family); counted on every stage (a later
stage has no ids: 8 bytes a token over). The head (last stage): the final norm as above and, for an LM head,
what ``token_logprobs`` keeps, ``8 V_local + 8 + 1 + 4`` (two fp32 copies of the logits slice, the target index,
the in-slice mask, the picked log-probability), and an int64 per sequence (its last token's index). The algorithm's
loss over the log-probabilities and the gradients that exist during the backward pass are not counted.

Not counted: the padded SDPA path (``_sdpa_padded``, taken when a batch's lengths differ a little) pads ``q``,
``k``, ``v``, the output and the log-sum-exp to the longest sequence and keeps a boolean ``L x L`` mask per
sequence (``L`` bytes per token) and an int64 row index per token beside the per-sequence one; flash-attn (CUDA,
when installed) keeps ``q``, ``k`` and ``v`` without copies and hands the output projection a view of its output
(``q_out e + 8`` less than counted); a mixture-of-experts block is costed as a dense block of its average MLP
width (its router and dispatch buffers are not counted).
"""

from __future__ import annotations

from typing import assert_never

from restage.models.arch import ModelConfig
from restage.models.flops import block_shape

FP32_BYTES = 4
INDEX_BYTES = 8  # int64 token indices
LOGIT_BYTES = 4  # logits are materialised in fp32 for log-probabilities and losses


def norm_activation_bytes_per_token(cfg: ModelConfig, e: int) -> int:
    """Bytes one of the model's hidden-size norms saves per token: RMSNorm its fp32 input and ``rsqrt``, the
    normalised value and its output; LayerNorm its input, output, mean and reciprocal deviation."""
    match cfg.traits.norm:
        case "layernorm":
            return 2 * e * cfg.hidden_size + 2 * FP32_BYTES
        case "rmsnorm":
            return FP32_BYTES * cfg.hidden_size + FP32_BYTES + 2 * e * cfg.hidden_size
        case _:
            assert_never(cfg.traits.norm)


def block_activation_bytes_per_token(cfg: ModelConfig, tp: int, e: int) -> int:
    """Bytes one block saves for its backward pass per token, on one TP rank (``e``: bytes per model element)."""
    s = block_shape(cfg, tp)
    heads, kv_heads = cfg.num_heads // tp, cfg.num_kv_heads // tp
    head_norms = 0
    if cfg.qk_norm:
        head_norms = sum((FP32_BYTES + e) * width + FP32_BYTES * n for width, n in ((s.q_out, heads), (s.kv_out, kv_heads)))
    attention = INDEX_BYTES + (3 * s.q_out + 2 * s.kv_out) * e + FP32_BYTES * heads
    mlp = (4 if s.gated else 2) * s.inter * e
    return 2 * norm_activation_bytes_per_token(cfg, e) + head_norms + attention + mlp


def forward_activation_bytes_per_token(cfg: ModelConfig, e: int) -> int:
    """Bytes a stage's forward saves once per token whatever its blocks: the embedding's int64 token ids and
    RoPE's two tables (none for GPT-2, which adds learned positions)."""
    match cfg.traits.positions:
        case "learned":
            return INDEX_BYTES
        case "rope":
            return INDEX_BYTES + 2 * cfg.head_dim * e
        case _:
            assert_never(cfg.traits.positions)


def head_activation_bytes_per_token(cfg: ModelConfig, tp: int, e: int) -> int:
    """Bytes the last stage's head saves per token: the final norm and, for an LM head, what
    ``StageModule.token_logprobs`` keeps (two fp32 copies of this rank's logits slice, the int64 target index,
    the in-slice mask and the picked fp32 log-probability); a scalar head keeps only its norm's output."""
    norm = norm_activation_bytes_per_token(cfg, e)
    if cfg.is_critic:
        return norm
    return norm + 2 * FP32_BYTES * block_shape(cfg, tp).head_out + INDEX_BYTES + 1 + FP32_BYTES


def forward_workspace_elements_per_token(cfg: ModelConfig, tp: int) -> float:
    """Elements a forward without autograd holds live per token, about one block's worth: the inputs and outputs
    of the two norms, q, k, v and attention's output, the MLP's intermediates (what a training step keeps for its
    backward is ``activations.block_activation_bytes_per_token``)."""
    s = block_shape(cfg, tp)
    replicated = 4 * s.hidden
    sharded = 2 * s.q_out + 2 * s.kv_out + (3 if s.gated else 2) * s.inter
    return replicated + sharded


def forward_workspace_bytes(cfg: ModelConfig, tp: int, tokens: float, e: int) -> float:
    """Live activations of a forward without autograd: about one block's worth."""
    return forward_workspace_elements_per_token(cfg, tp) * tokens * e
