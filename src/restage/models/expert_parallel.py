"""Expert parallelism: tokens sent to the rank that holds their expert and back, with two all-to-alls.

Under ep (``layout.py``) the ``ep`` dp ranks of one ep group each hold ``E / ep`` whole experts
(TP-split inside as without ep). Every rank routes its own tokens; ``exchange_to_experts`` sends
each (token, chosen expert) row to the ep peer that owns the expert (first the per-expert counts,
then the rows with ``all_to_all_single`` and split sizes), the local experts compute on what
they received from all peers, and the outputs travel back along the same splits. Both exchanges
are autograd functions whose backward is the reverse exchange, so training needs nothing more.
With tp > 1 every TP rank does the same exchange with the peers that share its TP index (the
routing is the same on all TP ranks) and the partial expert outputs are summed over TP by the
caller, once per layer.

Lockstep: every rank of an ep group must call each sparse layer the same number of times. A rank
with no tokens still calls it (zero rows): it sends nothing but computes for its peers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from restage.models.parallel import ParallelContext


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; backward is the exchange with the splits swapped."""

    # ctx: torch's FunctionCtx, which carries what forward saves as ad-hoc attributes (so Any).
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        out = x.new_empty((sum(recv_sizes), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        send_sizes, recv_sizes = ctx.sizes
        out = grad.new_empty((sum(send_sizes), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_sizes, recv_sizes, group=ctx.group)
        return out, None, None, None


def all_to_all(x: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], ctx: ParallelContext) -> torch.Tensor:
    """Rows ``x`` split by ``send_sizes`` to the ep peers in order; returns what they sent, by peer."""
    out: torch.Tensor = _AllToAll.apply(x, send_sizes, recv_sizes, ctx.ep_group)  # type: ignore[no-untyped-call]  # torch leaves apply untyped
    return out


def local_experts(num_experts: int, ctx: ParallelContext) -> range:
    """The global indices of the experts this rank holds."""
    per_rank = num_experts // ctx.ep_size
    return range(ctx.ep_rank * per_rank, (ctx.ep_rank + 1) * per_rank)


def run_experts_parallel(routed: torch.Tensor, counts: torch.Tensor,
                         experts: Sequence[Callable[[torch.Tensor], torch.Tensor]],
                         ctx: ParallelContext) -> torch.Tensor:
    """Outputs of the experts for ``routed`` rows, which are sorted by global expert (``counts[e]`` rows each).

    The rows go to the ranks holding their experts, ``experts`` (this rank's, in order) compute on
    every row they received, and the outputs come back in the order of ``routed``.
    """
    ep, per_rank = ctx.ep_size, len(experts)
    counts = counts.to(torch.int64)
    received = torch.empty_like(counts)  # [ep * per_rank]: rows from peer j for my expert l at j * per_rank + l
    dist.all_to_all_single(received, counts, group=ctx.ep_group)
    send_sizes = counts.view(ep, per_rank).sum(dim=1).tolist()
    by_peer = received.view(ep, per_rank)
    recv_sizes = by_peer.sum(dim=1).tolist()
    rows = all_to_all(routed, send_sizes, recv_sizes, ctx)
    # Group the received rows by local expert (peer order kept inside each expert), run, and undo the grouping.
    expert_of_row = torch.arange(per_rank, device=rows.device).repeat(ep).repeat_interleave(
        by_peer.reshape(-1).to(rows.device))
    order = expert_of_row.argsort(stable=True)
    grouped = rows.index_select(0, order)
    sizes = by_peer.sum(dim=0).tolist()
    # Every expert runs, on zero rows if none came, so each has a (zero) gradient.
    outputs = torch.cat([expert(part) for expert, part in zip(experts, torch.split(grouped, sizes), strict=True)])
    back = outputs.index_select(0, order.argsort())
    return all_to_all(back, recv_sizes, send_sizes, ctx)


def average_gradients(module: torch.nn.Module, ctx: ParallelContext) -> None:
    """Average ``.grad`` over data parallelism where nothing else does it (plain training, ZeRO-0 with ep).

    Shared parameters: summed over the dp group, divided by dp. An expert's gradient already sums
    what every ep peer's tokens contributed (the exchange's backward brought it home), so it is
    summed over the expert-dp group (the replicas holding the same experts) and also divided by dp:
    the mean over all dp replicas' losses, as without ep.
    """
    dp = ctx.strategy.dp
    if dp == 1:
        return
    for name, param in module.named_parameters():
        if param.grad is None:
            continue
        expert = ".experts." in name
        group, size = (ctx.edp_group, len(ctx.edp_ranks)) if expert else (ctx.dp_group, dp)
        if size > 1:
            dist.all_reduce(param.grad, group=group)
        param.grad.div_(dp)
