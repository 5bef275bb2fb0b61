"""The mixture-of-experts MLP (Mixtral, Qwen3-MoE) and its router log, as plain PyTorch with TP.

Routing follows transformers: softmax of the router logits in fp32, the top-k experts per token,
their probabilities renormalised to sum to 1 when ``norm_topk_prob`` (Mixtral always). No
capacity limit: every token reaches its k experts, so no token is ever dropped.

Tensor parallelism: the router is replicated and reads the replicated hidden states (so its
gradient is whole on every TP rank); each expert is split like a dense MLP (gate and up
column-parallel, down row-parallel). The experts' partial outputs are weighted, summed and
all-reduced once per layer; the routing weights enter through ``copy_to_tp`` so their gradient,
partial on each rank, is summed over TP.

Load-balancing loss: per sparse layer, Switch Transformer's ``E * sum_e f_e * P_e`` (``f_e``
the fraction of top-k assignments to expert ``e``, ``P_e`` its mean router probability over the
micro-batch's tokens), averaged over the model's sparse layers. transformers computes one such
term over all layers' tokens pooled; the per-layer form equals it for a one-sparse-layer model
and, unlike the pooled one, is a sum over layers, so each pipeline stage adds its own layers'
share and the total is exact under pp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.types import Device

from restage.models.arch import ModelConfig
from restage.models.expert_parallel import local_experts, run_experts_parallel
from restage.models.parallel import (
    ColumnParallelLinear,
    ParallelContext,
    copy_to_tp,
    reduce_from_tp,
)
from restage.models.sharding import split_range


class RouterLog:
    """What the sparse layers of one stage report while training: load-balancing losses and expert loads.

    Pass one to ``StageModule.forward(routing=...)``. ``take_aux_loss`` returns (and forgets) the
    coefficient-weighted loss of the forwards since the last call; the loads and the unweighted
    loss accumulate for the statistics (``stats``).
    """

    def __init__(self, cfg: ModelConfig, aux_coef: float | None = None):
        self.cfg = cfg
        self.aux_coef = cfg.router_aux_loss_coef if aux_coef is None else aux_coef
        self._pending: list[torch.Tensor] = []
        self.loads: dict[int, torch.Tensor] = {}  # layer -> [E] top-k assignments counted (fp64, detached)
        self.aux_sum = 0.0  # unweighted per-forward losses of this stage's layers, summed
        self.forwards = 0

    def record(self, layer: int, probs: torch.Tensor, top_index: torch.Tensor) -> None:
        """One sparse layer's fp32 router probabilities ``[T, E]`` and chosen experts ``[T, k]``."""
        experts = self.cfg.num_experts
        counts = torch.bincount(top_index.reshape(-1), minlength=experts).to(torch.float64)
        tokens = max(1, probs.shape[0])
        loss = experts * (counts.to(probs.dtype) / tokens * probs.mean(dim=0)).sum()
        self._pending.append(loss / len(self.cfg.sparse_layers))
        self.loads[layer] = self.loads.get(layer, torch.zeros_like(counts)) + counts.detach()

    def take_aux_loss(self) -> torch.Tensor | None:
        """The weighted load-balancing loss of this stage's layers since the last call (None if none ran)."""
        if not self._pending:
            return None
        loss = torch.stack(self._pending).sum()
        self._pending = []
        self.aux_sum += float(loss.detach())
        self.forwards += 1
        return self.aux_coef * loss

    def stats(self) -> dict[str, float]:
        """Per sparse layer, the most and least loaded expert's share of the assignments in multiples of the even
        share (1.0 is perfect balance), and the mean unweighted load-balancing loss per forward (this stage's part)."""
        out = {}
        for layer in sorted(self.loads):
            loads = self.loads[layer]
            share = loads / loads.sum().clamp(min=1) * self.cfg.num_experts
            out[f"router/layer{layer}/max_load"] = float(share.max())
            out[f"router/layer{layer}/min_load"] = float(share.min())
        if self.forwards:
            out["router/aux_loss"] = self.aux_sum / self.forwards
        return out


def router_stats(routing: RouterLog, ctx: ParallelContext, device: torch.device) -> dict[str, float]:
    """``routing.stats()`` over every pipeline stage of the replica (a collective over the PP group).

    Each stage logs only its own layers; the sum over stages gives every stage the whole model's.
    """
    if ctx.pp_size == 1:
        return routing.stats()
    cfg = routing.cfg
    layers = list(cfg.sparse_layers)
    table = torch.zeros(len(layers) + 1, cfg.num_experts, dtype=torch.float64)
    for row, layer in enumerate(layers):
        if layer in routing.loads:
            table[row] = routing.loads[layer].cpu()
    table[-1, 0] = routing.aux_sum
    table = table.to(device)
    dist.all_reduce(table, group=ctx.pp_group)
    whole = RouterLog(cfg, routing.aux_coef)
    whole.loads = {layer: table[row] for row, layer in enumerate(layers) if table[row].sum() > 0}
    whole.aux_sum, whole.forwards = float(table[-1, 0]), routing.forwards
    return whole.stats()


class Expert(nn.Module):
    """One expert: a SwiGLU MLP, this rank's TP slice of it; returns the partial (not yet all-reduced) output.

    Every weight is used through its own module's forward: ZeRO-3 gathers a module's parameters in
    hooks on that forward.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, dtype: torch.dtype, device: Device):
        super().__init__()
        lo, hi = split_range(cfg.moe_intermediate_size, ctx.tp_size, ctx.tp_rank)
        self.gate = ColumnParallelLinear(cfg.hidden_size, hi - lo, False, dtype, device)
        self.up = ColumnParallelLinear(cfg.hidden_size, hi - lo, False, dtype, device)
        # Row-parallel in layout ([hidden, local width]) but local: the all-reduce is the layer's, once for all experts.
        self.down = ColumnParallelLinear(hi - lo, cfg.hidden_size, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class Router(nn.Module):
    """The replicated router: logits ``[T, E]``."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: Device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((cfg.num_experts, cfg.hidden_size), dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MoEMLP(nn.Module):
    """Top-k routed experts in place of a block's MLP (``layers.<i>.mlp.router`` and ``.experts.<e>``)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer: int, dtype: torch.dtype, device: Device):
        super().__init__()
        self.ctx, self.layer, self.top_k = ctx, layer, cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        # A dense family given experts by hand (tests) routes as Mixtral does: weights in fp32.
        moe = cfg.traits.moe
        self.weights_in_model_dtype = moe is not None and moe.routing_weights_in_model_dtype
        self.router = Router(cfg, dtype, device)
        # Under ep only this rank's experts (expert_parallel.py); keyed by their global index either way.
        self.experts = nn.ModuleDict({str(e): Expert(cfg, ctx, dtype, device)
                                      for e in local_experts(cfg.num_experts, ctx)})
        self.num_experts = cfg.num_experts

    def forward(self, x: torch.Tensor, routing: RouterLog | None = None) -> torch.Tensor:
        probs = self.router(x).float().softmax(dim=-1)  # [T, E]
        top_probs, top_index = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            top_probs = top_probs.to(x.dtype)
        if routing is not None:
            routing.record(self.layer, probs, top_index)
        weights = copy_to_tp(top_probs, self.ctx).reshape(-1)
        x = copy_to_tp(x, self.ctx)
        # Sort the (token, slot) assignments by expert: each expert then reads one contiguous run.
        flat = top_index.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.top_k
        routed = x.index_select(0, token)
        if self.ctx.ep_size > 1:
            counts = torch.bincount(flat, minlength=self.num_experts)
            expert_out = run_experts_parallel(routed, counts, list(self.experts.values()), self.ctx)
        else:
            sizes = torch.bincount(flat, minlength=len(self.experts)).tolist()  # one host sync per layer
            # Every expert runs, on zero tokens if none chose it, so each has a (zero) gradient.
            expert_out = torch.cat([expert(part) for expert, part in
                                    zip(self.experts.values(), torch.split(routed, sizes), strict=True)])
        weighted = expert_out * weights.index_select(0, order).unsqueeze(-1)
        out = torch.zeros_like(x).index_add_(0, token, weighted.to(x.dtype))
        return reduce_from_tp(out, self.ctx)
