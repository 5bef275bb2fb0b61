"""The cost of a pass over a batch with a model: a train step (forward, backward, gradient reduction, optimizer
step) or a forward (inference), per pipeline stage and ZeRO stage. Generation is ``rollout_cost.py``'s."""

from __future__ import annotations

from restage.cluster import ClusterSpec
from restage.graph import MFC
from restage.layout import Layout
from restage.models.flops import block_shape
from restage.plan.activations import (
    LOGIT_BYTES,
    block_activation_bytes_per_token,
    forward_activation_bytes_per_token,
    forward_workspace_bytes,
    head_activation_bytes_per_token,
)
from restage.plan.comm import allgather_seconds, allreduce_seconds, p2p_seconds, reduce_scatter_seconds
from restage.plan.compute import ComputeModel
from restage.plan.layout_cost import (
    MFCCost,
    expert_exchange_seconds,
    max_stage_layers,
    sequences_per_rank,
    stage_seconds,
    worst_group,
)
from restage.plan.model_state import partitioned_elements, sharded_frozen, trained_zero_stage, worst_stage
from restage.plan.roles import ModelRole

# Optimizer steps on the host (offload_optimizer) run this many times slower than on the device.
_HOST_OPTIMIZER_SLOWDOWN = 10.0


def train_cost(cluster: ClusterSpec, compute: ComputeModel, mfc: MFC, role: ModelRole, layout: Layout, m: int) -> MFCCost:
    """A train step: ``epochs x minibatches`` optimizer steps, each a 1F1B pipeline of ``m`` micro-batches, the
    gradient reduction over dp and the optimizer step; memory for the activations 1F1B keeps in flight."""
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    b = sequences_per_rank(mfc, s.dp) / m
    seq = mfc.seq_tokens
    tokens = b * seq
    tp_group, dp_group, pp_group = worst_group(layout, "tp"), worst_group(layout, "dp"), worst_group(layout, "pp")
    recompute = role.gradient_checkpointing
    block = compute.block_forward(b, seq, s.tp, s.ep) * (2 if recompute else 1) + compute.block_backward(b, seq, s.tp, s.ep)
    head = compute.head_forward(tokens, s.tp) + compute.head_backward(tokens, s.tp)
    compute_s = stage_seconds(layout, cfg, block, compute.embed_forward(tokens) * 3, head)
    layers = max_stage_layers(cfg, s.pp)
    tp_s = layers * (6 if recompute else 4) * allreduce_seconds(cluster, tp_group, tokens * cfg.hidden_size * e)
    send_s = 2 * p2p_seconds(cluster, pp_group[0], pp_group[-1], tokens * cfg.hidden_size * e) if s.pp > 1 else 0.0
    params, trained, experts = worst_stage(cfg, s)
    gather_s = 0.0
    if role.zero_stage == 3:  # parameters gathered for the forward and again for the backward of every micro-batch
        gather_s = (3 if recompute else 2) * allgather_seconds(cluster, dp_group, params * e)
        if role.offload_params:  # DeepSpeed's offload_param: each gather first copies the rank's partition up
            gather_s += (3 if recompute else 2) * param_offload_fetch_seconds(cluster, params * e / s.dp)
    # ep: the forward's exchanges, the backward's reverse ones, and the recomputed forward's
    ep_s = (3 if recompute else 2) * expert_exchange_seconds(cluster, cfg, layout, tokens, e)
    per_micro = compute_s + tp_s + send_s + gather_s + ep_s
    pipeline = (m + s.pp - 1) * per_micro
    zero = trained_zero_stage(role.zero_stage, s.ep)
    # A LoRA model reduces and steps only its adapters; under ep the experts' gradients are reduced over their
    # expert-dp group (dp / ep ranks), the rest over dp.
    dp_s = sum(_gradient_reduction_seconds(cluster, group, elements * e, zero) for group, elements in
               ((dp_group, trained - experts), (worst_group(layout, "edp") if s.ep > 1 else dp_group, experts)))
    optim_s = compute.optimizer_step(partitioned_elements(trained, experts, s) if zero >= 1 else trained)
    if role.offload_optimizer:
        optim_s *= _HOST_OPTIMIZER_SLOWDOWN
    steps = mfc.epochs * mfc.minibatches
    seconds = steps * (pipeline + dp_s + optim_s)
    parts = {"compute_seconds": steps * (m + s.pp - 1) * compute_s, "tp_comm_seconds": steps * (m + s.pp - 1) * tp_s,
             "pp_send_seconds": steps * (m + s.pp - 1) * send_s, "zero3_gather_seconds": steps * (m + s.pp - 1) * gather_s,
             "pp_bubble_seconds": steps * (s.pp - 1) * per_micro, "dp_comm_seconds": steps * dp_s,
             "optimizer_seconds": steps * optim_s, "ep_comm_seconds": steps * (m + s.pp - 1) * ep_s}
    # Memory: 1F1B keeps min(m, pp) micro-batches of activations in flight on the first stage.
    in_flight = min(m, s.pp)
    block_bytes = block_activation_bytes_per_token(cfg, s.tp, e) * tokens
    per_layer = cfg.hidden_size * tokens * e if recompute else block_bytes
    acts = (layers * per_layer + forward_activation_bytes_per_token(cfg, e) * tokens) * in_flight
    if recompute:
        acts += block_bytes  # the block being recomputed
    head = head_activation_bytes_per_token(cfg, s.tp, e) * tokens  # final norm, fp32 logits for the log-probabilities
    transient = max(acts, acts / in_flight + head) if s.pp > 1 else acts + head
    if role.zero_stage == 3:
        transient += 2 * params * e / max(layers, 1)  # one gathered block (and its prefetched neighbour)
    return MFCCost(seconds, transient, parts)


def param_offload_fetch_seconds(cluster: ClusterSpec, partition_bytes: float) -> float:
    """One ZeRO-3 gather's host-to-device copy of a rank's parameter partition kept on the host (``offload_params``),
    over the device's host link (``host_bandwidth_bytes_per_second``)."""
    return partition_bytes / cluster.host_bandwidth_bytes_per_second


def _gradient_reduction_seconds(cluster: ClusterSpec, group: tuple[int, ...], grad_bytes: float, zero: int) -> float:
    """One optimizer step's gradient reduction over ``group`` (and ZeRO-1/2's gather of the updated parameters)."""
    if zero == 0:
        return allreduce_seconds(cluster, group, grad_bytes)
    if zero in (1, 2):
        return reduce_scatter_seconds(cluster, group, grad_bytes) + allgather_seconds(cluster, group, grad_bytes)
    return reduce_scatter_seconds(cluster, group, grad_bytes)


def inference_cost(cluster: ClusterSpec, compute: ComputeModel, mfc: MFC, role: ModelRole, layout: Layout,
                   m: int) -> MFCCost:
    """A forward over the batch in ``m`` micro-batches through the pipeline (a sharded frozen model gathering its
    parameters per layer); memory for one block's workspace and the logits."""
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    b = sequences_per_rank(mfc, s.dp) / m
    seq = mfc.seq_tokens
    tokens = b * seq
    tp_group, pp_group = worst_group(layout, "tp"), worst_group(layout, "pp")
    compute_s = stage_seconds(layout, cfg, compute.block_forward(b, seq, s.tp, s.ep), compute.embed_forward(tokens),
                               compute.head_forward(tokens, s.tp))
    layers = max_stage_layers(cfg, s.pp)
    tp_s = layers * 2 * allreduce_seconds(cluster, tp_group, tokens * cfg.hidden_size * e)
    send_s = p2p_seconds(cluster, pp_group[0], pp_group[-1], tokens * cfg.hidden_size * e) if s.pp > 1 else 0.0
    ep_s = expert_exchange_seconds(cluster, cfg, layout, tokens, e)
    exposed_gather_s = 0.0
    transient = forward_workspace_bytes(cfg, s.tp, tokens, e) + 2 * tokens * block_shape(cfg, s.tp).head_out * LOGIT_BYTES
    if sharded_frozen(role, mfc):
        # Every forward all-gathers the stage's parameters layer by layer over dp. With prefetch (the peers' ZeRO-3
        # and FSDP) the next layer's gather runs while the current layer computes, so per micro-batch the gathers
        # cost only what exceeds the compute, plus the first layer's; restage's runtime gathers each unit when
        # its forward starts, so every gather adds to the compute.
        params = worst_stage(cfg, s)[0]
        gather_s = allgather_seconds(cluster, worst_group(layout, "dp"), params * e)
        if role.prefetch_gathers:
            exposed_gather_s = max(gather_s - compute_s - tp_s, 0.0) + gather_s / max(layers, 1)
            transient += 2 * params * e / max(layers, 1)  # the gathered layer and the prefetched next one
        else:
            exposed_gather_s = gather_s
            transient += params * e / max(layers, 1)  # one gathered unit at a time
    per_micro = compute_s + tp_s + send_s + ep_s + exposed_gather_s
    rounds = m + s.pp - 1
    parts = {"compute_seconds": rounds * compute_s, "tp_comm_seconds": rounds * tp_s, "pp_send_seconds": rounds * send_s,
             "pp_bubble_seconds": (s.pp - 1) * per_micro, "ep_comm_seconds": rounds * ep_s}
    if exposed_gather_s:
        parts["zero3_gather_seconds"] = rounds * exposed_gather_s
    return MFCCost(rounds * per_micro, transient, parts)
