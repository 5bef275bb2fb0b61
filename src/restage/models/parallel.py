"""Tensor-parallel building blocks and the ParallelContext that tells a stage where it sits.

Megatron-style TP without sequence parallelism: activations between blocks are replicated on
every TP rank; column-parallel linears split their output features, row-parallel linears split
their input features and all-reduce the result. The embedding and LM head split the vocabulary,
and token log-probabilities / entropies are computed from the vocabulary shards without ever
gathering full-vocabulary logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.types import Device

from restage.layout import Coord, Layout, ProcessGroups, Strategy
from restage.models.sharding import split_range


@dataclass(frozen=True)
class ParallelContext:
    """Where one rank sits in a model's layout, and the groups it talks over.

    Ranks are global ranks. ``tp_group``/``pp_group`` are None when that degree is 1 (or in a
    single-process run, see ``single``). With ep > 1, ``ep_ranks`` are the dp peers that split the
    experts with this rank (tokens are exchanged with them) and ``edp_ranks`` the dp peers that hold
    the same experts (expert gradients are summed over them); both are ``()`` without ep.
    """

    strategy: Strategy
    coord: Coord
    tp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    tp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    ep_ranks: tuple[int, ...] = ()
    edp_ranks: tuple[int, ...] = ()
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None

    @classmethod
    def from_layout(cls, layout: Layout, groups: ProcessGroups | None, rank: int) -> ParallelContext:
        """The context of global ``rank`` in ``layout``; ``groups`` must hold the layout's groups
        (``ProcessGroups(layout.all_groups())``) and may be None for a one-rank layout."""
        coord = layout.coord(rank)
        if coord is None:
            raise ValueError(f"rank {rank} is not in layout {layout}")
        if groups is None and layout.size > 1:
            raise ValueError(f"layout {layout} spans several ranks and needs its ProcessGroups")
        tp, pp, dp = (layout.group_of(rank, kind) for kind in ("tp", "pp", "dp"))
        def group(ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
            return groups.get(ranks) if groups is not None else None

        if layout.strategy.ep == 1:
            return cls(layout.strategy, coord, tp, pp, dp, group(tp), group(pp), group(dp))
        ep, edp = layout.group_of(rank, "ep"), layout.group_of(rank, "edp")
        return cls(layout.strategy, coord, tp, pp, dp, group(tp), group(pp), group(dp), ep, edp, group(ep), group(edp))

    @classmethod
    def single(cls) -> ParallelContext:
        """No parallelism: one process, no torch.distributed needed."""
        return cls(Strategy(), Coord(0, 0, 0), (0,), (0,), (0,))

    @property
    def tp_size(self) -> int:
        return self.strategy.tp

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def pp_size(self) -> int:
        return self.strategy.pp

    @property
    def pp_stage(self) -> int:
        return self.coord.pp

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def shard_strategy(self) -> Strategy:
        """A strategy that shards parameters as this one does (dp shards nothing, so it is the least ep allows)."""
        s = self.strategy
        return Strategy(dp=s.ep, tp=s.tp, pp=s.pp, ep=s.ep)

    @property
    def ep_size(self) -> int:
        return self.strategy.ep

    @property
    def ep_rank(self) -> int:
        """Which share of the experts this rank holds (0 without ep)."""
        return self.strategy.ep_rank(self.coord.dp)

    @property
    def is_first_stage(self) -> bool:
        return self.coord.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coord.pp == self.strategy.pp - 1

    @property
    def prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp, tp), None on the first stage."""
        return None if self.is_first_stage else self.pp_ranks[self.coord.pp - 1]

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.pp_ranks[self.coord.pp + 1]

    @property
    def first_stage_rank(self) -> int:
        return self.pp_ranks[0]

    @property
    def last_stage_rank(self) -> int:
        return self.pp_ranks[-1]


# --- autograd-aware TP collectives -------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (input of a column-parallel op)."""

    # ctx: torch's FunctionCtx, which carries what forward saves as ad-hoc attributes (so Any).
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward; identity backward (the consumer is replicated on every TP rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp.RedOpType
                ) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=op, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def copy_to_tp(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    if ctx.tp_size == 1:
        return x
    out: torch.Tensor = _CopyToTP.apply(x, ctx.tp_group)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return out


def reduce_from_tp(x: torch.Tensor, ctx: ParallelContext,
                   op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    if ctx.tp_size == 1:
        return x
    out: torch.Tensor = _ReduceFromTP.apply(x, ctx.tp_group, op)  # type: ignore[no-untyped-call]  # as above
    return out


def gather_from_tp(x: torch.Tensor, ctx: ParallelContext, sizes: list[int]) -> torch.Tensor:
    """Concatenate along the last dim shards of (possibly unequal) ``sizes``; forward only."""
    if ctx.tp_size == 1:
        return x
    width = max(sizes)
    padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded, group=ctx.tp_group)
    return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)


# --- layers ------------------------------------------------------------------------------------


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: Device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ColumnParallelLinear(nn.Module):
    """``y_local = x W_local^T + b_local``: this rank's slice of the output features.

    The caller passes ``x`` through ``copy_to_tp`` once for all linears reading it (q, k, v).
    """

    def __init__(self, in_features: int, out_local: int, bias: bool, dtype: torch.dtype, device: Device):
        super().__init__()
        self.weight = _empty((out_local, in_features), dtype, device)
        self.bias = _empty((out_local,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over TP of x_local W_local^T, + b``: input features split, output replicated."""

    def __init__(self, in_local: int, out_features: int, bias: bool, ctx: ParallelContext, dtype: torch.dtype,
                 device: Device):
        super().__init__()
        self.ctx = ctx
        self.weight = _empty((out_features, in_local), dtype, device)
        self.bias = _empty((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.ctx)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over TP; also serves as a tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, dtype: torch.dtype, device: Device):
        super().__init__()
        self.ctx = ctx
        self.vocab_start, self.vocab_stop = split_range(vocab_size, ctx.tp_size, ctx.tp_rank)
        self.weight = _empty((self.vocab_stop - self.vocab_start, hidden_size), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_stop)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.ctx)


def lm_logits(hidden: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """This rank's vocabulary slice of the logits, ``[T, V_local]``."""
    return F.linear(copy_to_tp(hidden, ctx), weight)


def vocab_sizes(vocab_size: int, ctx: ParallelContext) -> list[int]:
    """Vocabulary slice width of every TP rank."""
    return [hi - lo for lo, hi in (split_range(vocab_size, ctx.tp_size, r) for r in range(ctx.tp_size))]


# --- vocabulary-parallel losses ----------------------------------------------------------------


def _shifted_exp(logits: torch.Tensor, ctx: ParallelContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits shifted by the global max, their exp, and the global sum of exp."""
    logits = logits.float()
    # The max is a constant shift for numerical safety; no gradient flows through it.
    top = logits.detach().max(dim=-1).values
    if ctx.tp_size > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ctx.tp_group)
    shifted = logits - top.unsqueeze(-1)
    exp = shifted.exp()
    total = reduce_from_tp(exp.sum(dim=-1), ctx)
    return shifted, exp, total


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, ctx: ParallelContext,
                            vocab_start: int, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[targets]`` from vocabulary shards; differentiable.

    ``logits`` is this rank's ``[T, V_local]`` slice starting at ``vocab_start``; ``targets`` is
    ``[T]`` global token ids. The result is ``[T]`` fp32, identical on every TP rank.
    """
    if temperature != 1.0:
        logits = logits / temperature
    shifted, _, total = _shifted_exp(logits, ctx)
    local = targets - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = reduce_from_tp(picked * inside, ctx)
    return picked - total.log()


def vocab_parallel_entropy(logits: torch.Tensor, ctx: ParallelContext, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per token, ``[T]`` fp32, from vocabulary shards."""
    if temperature != 1.0:
        logits = logits / temperature
    shifted, exp, total = _shifted_exp(logits, ctx)
    # H = log Z - sum_i p_i z_i with z the shifted logits and Z = sum exp(z).
    weighted = reduce_from_tp((exp * shifted).sum(dim=-1), ctx)
    return total.log() - weighted / total
