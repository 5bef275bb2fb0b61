"""The decoder: one pipeline stage's shard of a LLaMA-family or GPT-2 model, as plain PyTorch.

A block's MLP is a mixture of experts (``moe.py``) where ``cfg.is_sparse(layer)``.

``StageModule`` holds exactly the parameters ``sharding.shard_specs`` assigns to its
(pp stage, tp rank), under their canonical names (``layers.3.attn.q.weight``), so parameter
reallocation and checkpoints address them without a translation table. Activations are packed
``[T, hidden]`` (see ``packing.py``). The first stage takes token ids, the others the previous
stage's hidden states; the last stage returns its vocabulary slice of the logits
(``[T, V_local]``) or, for a critic, one value per token (``[T]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, assert_never

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.types import Device

from restage.errors import ConfigError, LayoutError
from restage.layout import Strategy
from restage.models.arch import ModelConfig
from restage.models.attention import AttentionMetadata, Decode, KVCache, KVStore, Prefill, varlen_attention
from restage.models.family import Activation
from restage.models.lora import apply_lora
from restage.models.moe import MoEMLP, RouterLog
from restage.models.packing import PackedBatch
from restage.models.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    lm_logits,
    vocab_parallel_entropy,
    vocab_parallel_logprobs,
)
from restage.models.rope import RopeTables, apply_rope_qk, rope_tables
from restage.models.sharding import shard_specs, split_range, stage_layers, validate_strategy

ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
}


class Weight(nn.Module):
    """A module that only holds ``.weight`` (position embedding, LM head, score head)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: Device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: Device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalise(x)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 and scale after casting back, as transformers does, so fp16/bf16 agree.
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class HeadNorm(RMSNorm):
    """Qwen3's q_norm / k_norm: RMSNorm over each head's ``head_dim`` values, one weight shared by all heads.

    The weight is replicated over TP but each rank normalises only its own heads, so its gradient
    is summed over the TP group (``copy_to_tp``: identity forward, all-reduce backward).
    """

    def __init__(self, head_dim: int, eps: float, ctx: ParallelContext, dtype: torch.dtype, device: Device):
        super().__init__(head_dim, eps, dtype, device)
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_tp(self.weight, self.ctx) * self.normalise(x)


class LayerNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device: Device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def _norm(cfg: ModelConfig, dtype: torch.dtype, device: Device) -> RMSNorm | LayerNorm:
    match cfg.traits.norm:
        case "rmsnorm":
            return RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        case "layernorm":
            return LayerNorm(cfg.hidden_size, cfg.norm_eps, dtype, device)
        case unknown:
            assert_never(unknown)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer: int, dtype: torch.dtype, device: Device):
        super().__init__()
        self.ctx, self.layer, self.head_dim = ctx, layer, cfg.head_dim
        self.window = cfg.sliding_window
        heads, kv_heads, hidden = cfg.num_heads // ctx.tp_size, cfg.num_kv_heads // ctx.tp_size, cfg.hidden_size
        self.q = ColumnParallelLinear(hidden, heads * cfg.head_dim, cfg.qkv_bias, dtype, device)
        self.k = ColumnParallelLinear(hidden, kv_heads * cfg.head_dim, cfg.qkv_bias, dtype, device)
        self.v = ColumnParallelLinear(hidden, kv_heads * cfg.head_dim, cfg.qkv_bias, dtype, device)
        self.o = RowParallelLinear(heads * cfg.head_dim, hidden, cfg.o_bias, ctx, dtype, device)
        # Qwen3 normalises every query and key head over head_dim before RoPE.
        self.q_norm = HeadNorm(cfg.head_dim, cfg.norm_eps, ctx, dtype, device) if cfg.qk_norm else None
        self.k_norm = HeadNorm(cfg.head_dim, cfg.norm_eps, ctx, dtype, device) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, batch: PackedBatch, rope: RopeTables | None, cache: KVStore | None,
                attn: AttentionMetadata | None) -> torch.Tensor:
        tokens = x.shape[0]
        x = copy_to_tp(x, self.ctx)
        q = self.q(x).view(tokens, -1, self.head_dim)
        k = self.k(x).view(tokens, -1, self.head_dim)
        v = self.v(x).view(tokens, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope_qk(q, k, rope)
        match attn:
            case None:
                out = varlen_attention(q, k, v, batch, self.window)
            case Prefill():
                assert cache is not None, "a prefill stores into a cache"
                cache.prefill(self.layer, attn, batch, k, v)
                out = varlen_attention(q, k, v, batch, self.window)
            case Decode():
                assert cache is not None, "a decode step attends to a cache"
                out = cache.decode_attention(self.layer, attn, q, k, v, self.window)
            case _:
                assert_never(attn)
        projected: torch.Tensor = self.o(out.reshape(tokens, -1))
        return projected


class MLP(nn.Module):
    """SwiGLU (``gate``, ``up``, ``down``) for the LLaMA family, ``up``/``down`` with GELU for GPT-2."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: Device):
        super().__init__()
        self.ctx = ctx
        lo, hi = split_range(cfg.intermediate_size, ctx.tp_size, ctx.tp_rank)
        family, hidden = cfg.traits, cfg.hidden_size
        self.act = ACTIVATIONS[cfg.act]
        self.gate = ColumnParallelLinear(hidden, hi - lo, False, dtype, device) if family.gated_mlp else None
        self.up = ColumnParallelLinear(hidden, hi - lo, family.mlp_bias, dtype, device)
        self.down = RowParallelLinear(hi - lo, hidden, family.mlp_bias, ctx, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.ctx)
        hidden = self.act(self.up(x)) if self.gate is None else self.act(self.gate(x)) * self.up(x)
        out: torch.Tensor = self.down(hidden)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer: int, dtype: torch.dtype, device: Device):
        super().__init__()
        self.attn_norm = _norm(cfg, dtype, device)
        self.attn = Attention(cfg, ctx, layer, dtype, device)
        self.mlp_norm = _norm(cfg, dtype, device)
        self.mlp: MLP | MoEMLP = MoEMLP(cfg, ctx, layer, dtype, device) if cfg.is_sparse(layer) else MLP(
            cfg, ctx, dtype, device)

    def forward(self, h: torch.Tensor, batch: PackedBatch, rope: RopeTables | None, cache: KVStore | None,
                attn: AttentionMetadata | None, routing: RouterLog | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), batch, rope, cache, attn)
        mlp_out: torch.Tensor = (self.mlp(self.mlp_norm(h), routing) if isinstance(self.mlp, MoEMLP)
                                 else self.mlp(self.mlp_norm(h)))
        return h + mlp_out


class StageModule(nn.Module):
    """The shard of one model that one rank holds: its stage's layers, its TP slice of each."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype = torch.float32,
                 device: Device = None):
        super().__init__()
        strategy = ctx.shard_strategy
        validate_strategy(cfg, strategy)
        self.cfg, self.ctx, self.dtype = cfg, ctx, dtype
        self.hf_config: dict[str, Any] | None = None  # the config.json it was loaded from (load_stage); a save keeps its keys
        # Training keeps only each block's input and recomputes the block in its backward (checkpoint_blocks).
        self.recompute_blocks = False
        self.layer_range = stage_layers(cfg, ctx.pp_size)[ctx.pp_stage]
        first, last = ctx.is_first_stage, ctx.is_last_stage
        self.tied_head = cfg.tied_embeddings and not cfg.is_critic
        if first:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype, device)
            match cfg.traits.positions:
                case "learned":
                    self.pos_embed = Weight((cfg.max_positions, cfg.hidden_size), dtype, device)
                case "rope":
                    pass
                case unknown:
                    assert_never(unknown)
        self.layers = nn.ModuleDict({str(i): Block(cfg, ctx, i, dtype, device) for i in range(*self.layer_range)})
        if last:
            self.final_norm = _norm(cfg, dtype, device)
            if cfg.is_critic:
                self.score = Weight((1, cfg.hidden_size), dtype, device)
            elif not cfg.tied_embeddings:
                vocab_lo, vocab_hi = split_range(cfg.vocab_size, ctx.tp_size, ctx.tp_rank)
                self.lm_head = Weight((vocab_hi - vocab_lo, cfg.hidden_size), dtype, device)
            elif not first:  # the last stage's own copy of the tied embedding, used as the head
                self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, dtype, device)
        if cfg.lora is not None:
            apply_lora(self, cfg, ctx)  # adapters on the targeted linears; the base frozen
        self._check_contract(strategy)

    def _check_contract(self, strategy: Strategy) -> None:
        expected = {s.param.name: s.shape for s in shard_specs(self.cfg, strategy, self.ctx.pp_stage, self.ctx.tp_rank,
                                                               self.ctx.ep_rank)}
        actual = {name: tuple(p.shape) for name, p in self.named_parameters()}
        if expected != actual:
            raise LayoutError(f"decoder parameters differ from sharding.shard_specs: {set(expected) ^ set(actual)}")

    def checkpoint_blocks(self, on: bool = True) -> None:
        """Gradient checkpointing (``models.<m>.gradient_checkpointing``): a training forward keeps each block's
        input only and recomputes the block's activations in the backward, one block at a time."""
        if on and any(self.cfg.is_sparse(i) for i in range(*self.layer_range)):
            # A recomputed sparse block would log its router's loss and loads a second time.
            raise ConfigError("gradient_checkpointing is not supported for mixture-of-experts models; set "
                              "models.<name>.gradient_checkpointing: false")
        self.recompute_blocks = on

    @property
    def vocab_start(self) -> int:
        """First token id of this rank's vocabulary slice of the logits."""
        return split_range(self.cfg.vocab_size, self.ctx.tp_size, self.ctx.tp_rank)[0]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if hasattr(self, "lm_head") else self.embed.weight

    def forward(self, inputs: torch.Tensor, batch: PackedBatch, cache: KVStore | None = None,
                select: torch.Tensor | None = None, routing: RouterLog | None = None, *,
                attn: AttentionMetadata | None = None) -> torch.Tensor:
        """Run this stage on a packed batch.

        ``inputs``: token ids ``[T]`` on the first stage, hidden states ``[T, hidden]`` elsewhere.
        ``cache`` and ``attn``: the KV cache and what this forward does with it (``attention.Prefill``: store the
        batch's keys/values in its rows; ``attention.Decode``: one token per row against its cache), both or neither.
        ``select``: on the last stage, indices of the tokens whose logits/values are wanted
        (e.g. each sequence's last token during generation); all tokens when None.
        ``routing``: for a mixture-of-experts model, where its sparse layers report their
        load-balancing loss and expert loads (training, ``pipeline.train_1f1b``).
        """
        h = self.embed(inputs) if self.ctx.is_first_stage else inputs
        rope: RopeTables | None = None
        match self.cfg.traits.positions:
            case "learned":
                if self.ctx.is_first_stage:
                    h = h + F.embedding(batch.positions, self.pos_embed.weight)
            case "rope":
                rope = rope_tables(batch.positions, self.cfg.head_dim, self.cfg.rope_theta, h.dtype, self.cfg.rope_scaling)
            case unknown:
                assert_never(unknown)
        if (cache is None) != (attn is None):
            raise ValueError("StageModule.forward: give a KV cache together with its attention metadata, or neither")
        recompute = self.recompute_blocks and torch.is_grad_enabled() and cache is None
        for block in self.layers.values():
            if recompute:  # non-reentrant: the recomputed forward runs inside the backward, in block order on every rank
                h = torch.utils.checkpoint.checkpoint(block, h, batch, rope, None, None, routing, use_reentrant=False)
            else:
                h = block(h, batch, rope, cache, attn, routing)
        if not self.ctx.is_last_stage:
            return h
        if select is not None:
            h = h.index_select(0, select)
        h = self.final_norm(h)
        if self.cfg.is_critic:
            return F.linear(h, self.score.weight).squeeze(-1)
        return lm_logits(h, self.head_weight, self.ctx)

    def token_logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, batch: PackedBatch,
                       temperature: float = 1.0) -> torch.Tensor:
        """``[T]`` fp32 ``log p(tokens[t+1] | tokens[..t])`` inside each sequence, 0 at each sequence's last token.

        ``logits`` is this (last-stage) rank's vocabulary slice; nothing is gathered over TP.
        """
        targets = torch.roll(tokens, -1)
        logprobs = vocab_parallel_logprobs(logits, targets, self.ctx, self.vocab_start, temperature)
        return logprobs.index_fill(0, batch.last_token_index(), 0.0)

    def token_entropy(self, logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``[T]`` fp32 entropy of the next-token distribution at every position."""
        return vocab_parallel_entropy(logits, self.ctx, temperature)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        """An empty KV cache for this stage's layers."""
        kv_heads = self.cfg.num_kv_heads // self.ctx.tp_size
        device = next(self.parameters()).device
        return KVCache(range(*self.layer_range), batch_size, max_len, kv_heads, self.cfg.head_dim, self.dtype, device)
