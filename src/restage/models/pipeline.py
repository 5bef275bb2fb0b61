"""Pipeline-parallel execution over micro-batches: forward for inference, 1F1B for training.

Every stage of a pipeline is handed the same list of micro-batches (token ids and packed-batch
metadata are small); only hidden states and their gradients travel between stages, so a
receiver always knows the shape it expects (``[tokens, hidden]``).

``train_1f1b`` runs the one-forward-one-backward schedule: stage ``s`` of ``P`` first runs
``P - s - 1`` warm-up forwards, then alternates one forward and one backward, then drains the
remaining backwards; at most ``P - s`` micro-batches hold activations at once. The caller
supplies the loss (``loss_fn``) and may route every backward through its own hook
(``backward_fn``), e.g. a DeepSpeed engine.

Mixture-of-experts models add their load-balancing loss (``moe.RouterLog``) in training: every
stage adds its own sparse layers' share of a micro-batch's loss to what it backpropagates for
that micro-batch (the last stage to the ``loss_fn`` loss, the others beside the output gradient),
so the sum over stages is the whole model's loss, as on one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, assert_never

import torch
import torch.distributed as dist

from restage.models.decoder import StageModule
from restage.models.moe import RouterLog
from restage.models.packing import PackedBatch


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: packed token ids, their metadata, and whatever the loss needs."""

    tokens: torch.Tensor  # [T] int64
    batch: PackedBatch
    extra: Any = None  # e.g. target ids, advantages, masks; handed to loss_fn / post_fn untouched


LossFn = Callable[[torch.Tensor, MicroBatch], Any]  # returns a scalar loss, or (loss, anything)


class BackwardFn(Protocol):
    """``(tensor, grad or None for a loss[, a loss of this stage's own to add])``; see ``train_1f1b``."""

    def __call__(self, tensor: torch.Tensor, grad: torch.Tensor | None, stage_loss: torch.Tensor | None = None, /
                 ) -> None: ...


def default_backward(tensor: torch.Tensor, grad: torch.Tensor | None, stage_loss: torch.Tensor | None = None) -> None:
    if stage_loss is None:
        torch.autograd.backward(tensor, grad)
    else:
        torch.autograd.backward([tensor, stage_loss], [grad, None])


P2PKind = Literal["send", "recv"]
Direction = Literal["forward", "backward"]  # which way a tensor travels along the pipeline


def p2p(ops: Sequence[tuple[P2PKind, torch.Tensor, int]]) -> None:
    """Run sends and receives together, so two neighbours exchanging at once cannot deadlock."""
    if not ops:
        return
    for request in dist.batch_isend_irecv([_p2p_op(kind, tensor, peer) for kind, tensor, peer in ops]):
        request.wait()


def _p2p_op(kind: P2PKind, tensor: torch.Tensor, peer: int) -> dist.P2POp:
    match kind:
        case "send":
            return dist.P2POp(dist.isend, tensor, peer)
        case "recv":
            return dist.P2POp(dist.irecv, tensor, peer)
        case unknown:
            assert_never(unknown)


def _hidden_buffer(module: StageModule, mb: MicroBatch) -> torch.Tensor:
    return torch.empty(mb.batch.num_tokens, module.cfg.hidden_size, dtype=module.dtype, device=mb.tokens.device)


def send_tensor(tensor: torch.Tensor, peer: int | None) -> None:
    """Send to the neighbouring stage ``peer`` (``ctx.next_rank``/``prev_rank``; None there is a caller's bug)."""
    assert peer is not None, "no neighbouring stage to send to"
    p2p([("send", tensor.contiguous(), peer)])


def recv_tensor(buffer: torch.Tensor, peer: int | None) -> torch.Tensor:
    assert peer is not None, "no neighbouring stage to receive from"
    p2p([("recv", buffer, peer)])
    return buffer


@torch.no_grad()
def pipeline_forward(module: StageModule, micro_batches: Sequence[MicroBatch],
                     post_fn: Callable[[torch.Tensor, MicroBatch], Any] | None = None) -> list[Any] | None:
    """Forward every micro-batch through the pipeline.

    On the last stage returns ``[post_fn(output, mb)]`` per micro-batch (the raw output — logits
    slice or values — when ``post_fn`` is None); on other stages returns None.
    """
    ctx = module.ctx
    results = []
    for mb in micro_batches:
        x = mb.tokens if ctx.is_first_stage else recv_tensor(_hidden_buffer(module, mb), ctx.prev_rank)
        out = module(x, mb.batch)
        if not ctx.is_last_stage:
            send_tensor(out, ctx.next_rank)
        else:
            results.append(post_fn(out, mb) if post_fn is not None else out)
    return results if ctx.is_last_stage else None


def train_1f1b(module: StageModule, micro_batches: Sequence[MicroBatch], loss_fn: LossFn,
               backward_fn: BackwardFn = default_backward, sync_tied: bool = True,
               routing: RouterLog | None = None, aux_scale: float = 1.0) -> list[Any] | None:
    """Forward and backward every micro-batch with the 1F1B schedule; gradients accumulate in ``.grad``.

    ``loss_fn(output, mb)`` runs on the last stage and returns the micro-batch's loss (scale it
    as you want it summed, e.g. by 1 / number of micro-batches), or ``(loss, stats)``.
    ``backward_fn(tensor, grad[, stage_loss])`` is called once per micro-batch on every stage: with
    ``(loss, None)`` on the last stage and ``(stage output, its gradient)`` elsewhere, plus, off
    the last stage of a mixture of experts, ``stage_loss``: the load-balancing loss of this
    stage's layers, scaled like a ``loss_fn`` loss, to add to what it backpropagates. With tied
    embeddings and pp > 1, ``sync_tied`` sums the two copies' gradients at the end.
    A mixture-of-experts model reports into ``routing`` (a fresh ``RouterLog`` when None); its
    load-balancing loss per micro-batch is multiplied by ``aux_scale`` (what ``loss_fn`` scales
    a micro-batch's loss by, e.g. 1 / number of micro-batches).
    Returns the ``loss_fn`` results on the last stage, None elsewhere.
    """
    ctx = module.ctx
    n = len(micro_batches)
    warmup = min(ctx.pp_size - ctx.pp_stage - 1, n)
    in_flight: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []  # (micro-batch, input, output)
    results: list[Any] = []
    if routing is None and module.cfg.is_moe:
        routing = RouterLog(module.cfg)
    stage_losses: dict[int, torch.Tensor] = {}  # micro-batch -> this stage's own loss (off the last stage)

    def recv_forward(i: int) -> torch.Tensor | None:
        if ctx.is_first_stage:
            return None
        return recv_tensor(_hidden_buffer(module, micro_batches[i]), ctx.prev_rank).requires_grad_()

    def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
        mb = micro_batches[i]
        out: torch.Tensor = module(mb.tokens if x is None else x, mb.batch, routing=routing)
        aux = routing.take_aux_loss() if routing is not None else None
        if aux is not None:
            aux = aux * aux_scale
        if not ctx.is_last_stage:
            if aux is not None:
                stage_losses[i] = aux
            return out
        result = loss_fn(out, mb)
        loss: torch.Tensor = result[0] if isinstance(result, tuple) else result
        results.append(_detached(result))
        return loss if aux is None else loss + aux

    def backward(i: int, out: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor | None) -> torch.Tensor | None:
        stage_loss = stage_losses.pop(i, None)
        if stage_loss is None:  # a dense model's hook may take two arguments only
            backward_fn(out, grad)
        else:
            backward_fn(out, grad, stage_loss)
        return None if x is None else x.grad

    def neighbour(direction: Direction, sending: bool) -> int | None:
        """The stage a tensor travelling ``direction`` goes to (``sending``) or comes from."""
        match direction:
            case "forward":
                return ctx.next_rank if sending else ctx.prev_rank
            case "backward":
                return ctx.prev_rank if sending else ctx.next_rank
            case unknown:
                assert_never(unknown)

    def exchange(send_kind: Direction, tensor: torch.Tensor | None, recv_kind: Direction | None,
                 recv_like: torch.Tensor | None) -> torch.Tensor | None:
        """Send to one neighbour and receive from a neighbour in one batch; returns the received tensor."""
        ops: list[tuple[P2PKind, torch.Tensor, int]] = []
        peer_out = neighbour(send_kind, sending=True)
        if tensor is not None and peer_out is not None:
            ops.append(("send", tensor.detach().contiguous(), peer_out))
        received = None
        if recv_kind is not None:
            peer_in = neighbour(recv_kind, sending=False)
            if peer_in is not None and recv_like is not None:
                received = torch.empty_like(recv_like)
                ops.append(("recv", received, peer_in))
        p2p(ops)
        return received

    for i in range(warmup):
        x = recv_forward(i)
        out = forward(i, x)
        exchange("forward", out, None, None)
        in_flight.append((i, x, out))
    steady = n - warmup
    x = recv_forward(warmup) if steady > 0 else None
    for j in range(steady):
        i = warmup + j
        out = forward(i, x)
        in_flight.append((i, x, out))
        oldest, x_old, out_old = in_flight.pop(0)
        like = _hidden_buffer(module, micro_batches[oldest])
        grad_out = exchange("forward", None if ctx.is_last_stage else out, None if ctx.is_last_stage else "backward", like)
        grad_in = backward(oldest, out_old, grad_out if not ctx.is_last_stage else None, x_old)
        if j == steady - 1:
            exchange("backward", grad_in, None, None)
        else:
            nxt = micro_batches[i + 1]
            x = exchange("backward", grad_in, None if ctx.is_first_stage else "forward", _hidden_buffer(module, nxt))
            if x is not None:
                x.requires_grad_()
    for _ in range(warmup):
        oldest, x_old, out_old = in_flight.pop(0)
        grad_out = exchange("forward", None, "backward", _hidden_buffer(module, micro_batches[oldest]))
        grad_in = backward(oldest, out_old, grad_out, x_old)
        exchange("backward", grad_in, None, None)
    if sync_tied:
        sync_tied_embedding_grads(module)
    return results if ctx.is_last_stage else None


def _detached(result: object) -> object:
    if isinstance(result, torch.Tensor):
        return result.detach()
    if isinstance(result, tuple):
        return tuple(_detached(r) for r in result)
    return result


def sync_tied_embedding_grads(module: StageModule) -> None:
    """Sum ``embed.weight`` gradients of the first and last stage (tied embeddings, pp > 1)."""
    ctx = module.ctx
    if ctx.pp_size == 1 or not module.tied_head or not (ctx.is_first_stage or ctx.is_last_stage):
        return
    weight = module.embed.weight
    mine = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    peer = ctx.last_stage_rank if ctx.is_first_stage else ctx.first_stage_rank
    theirs = torch.empty_like(mine)
    p2p([("send", mine.contiguous(), peer), ("recv", theirs, peer)])
    weight.grad = mine + theirs
