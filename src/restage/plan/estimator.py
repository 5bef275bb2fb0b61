"""Time and peak memory per rank of one MFC under one layout.

Time: compute of the bottleneck pipeline stage (``compute.py``: roofline or profile), TP
all-reduces (two per block per pass), the 1F1B pipeline's fill and drain plus stage-to-stage
sends, ZeRO's gradient reduction / parameter gathering over the DP group, the optimizer step,
and generation on restage's rollout engine (``engines.py``: slots, refill, one prefill per prompt group,
CUDA graphs where the runtime replays them) or, for a peer that generates so, one batch decoded to the end. Collectives are not
assumed to overlap with compute. Memory per rank: parameters, gradients and optimizer states
per ZeRO stage (``state_bytes``, held while the layout is the model's home; for a LoRA model gradients and
optimizer state only of the adapters), and what exists only
while the MFC runs (``transient_bytes``): activations (what every block saves for its backward,
``activations.py``, or with recomputation only block inputs), logits, the KV cache.

Every number is for the worst pipeline stage and the largest TP chunk, so one figure holds for
every rank of the mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import assert_never

from restage.cluster import ClusterSpec
from restage.graph import MFC
from restage.layout import Layout, Strategy
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.models.sharding import is_adapter, shard_bytes, shard_specs, stage_layers, validate_strategy
from restage.plan.activations import (
    block_activation_bytes_per_token,
    forward_activation_bytes_per_token,
    head_activation_bytes_per_token,
)
from restage.plan.comm import (
    allgather_seconds,
    allreduce_seconds,
    alltoall_seconds,
    broadcast_seconds,
    p2p_seconds,
    reduce_scatter_seconds,
)
from restage.plan.compute import DTYPE_BYTES, ProfiledCompute, RooflineCompute
from restage.plan.generation_cost import (
    GRAPH_BLOCK_SECONDS,
    HOST_CHECK_SECONDS,
    GenerationEngine,
    Occupancy,
    OneBatchEngine,
    RestageEngine,
    batched_generate_seconds,
    block_tokens,
    decode_rounds,
    flash_decodes,
    kv_budget_bytes,
    paged_flash,
    paged_occupancy,
    replays_graphs,
    restage_slots,
)
from restage.plan.nccl import bus_bandwidth
from restage.plan.profile import find_profile
from restage.rollout.budget import group_count
from restage.rollout.paged_cache import blocks_for

# Bytes per parameter of mixed-precision AdamW state: fp32 master copy, m and v. Plain fp32
# training keeps only m and v next to the parameters.
_OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}
# Optimizer steps on the host (offload_optimizer) run this many times slower than on the device.
_HOST_OPTIMIZER_SLOWDOWN = 10.0
LOGIT_BYTES = 4  # logits are materialised in fp32 for log-probabilities and losses


@dataclass(frozen=True)
class ModelRole:
    """One model of an experiment as the planner sees it: architecture and how it is trained."""

    name: str
    arch: ModelConfig
    dtype: str = "bf16"
    trainable: bool = False
    zero_stage: int = 1
    gradient_checkpointing: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_when_idle: bool = False
    # A frozen model's parameters partitioned over the DP ranks and all-gathered layer by layer in each forward
    # (DeepSpeed ZeRO-3 / FSDP inference, as the peers run reference and reward models). Restage's runtime runs it
    # too (``runtime/store/sharded_frozen.py``): ``models.<m>.shard_frozen`` sets it, ``plan.shard_frozen: auto`` lets the
    # search choose it (``planner.sharded_variant``), and ``plan/peers/defaults.py`` sets it for the peers that shard.
    shard_frozen: bool = False
    # Whether the sharded gathers are prefetched, the next layer's during this layer's compute: DeepSpeed ZeRO-3
    # (stage3_prefetch_bucket_size) and FSDP (forward_prefetch) do, as the peers run them (plan/peers/defaults.py);
    # restage's runtime/store/sharded_frozen.py gathers each unit as its forward starts, so all its gathers are exposed.
    prefetch_gathers: bool = False
    path: str = ""
    preset: str = ""

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Estimate:
    """Predicted cost of one MFC on one layout; bytes are per rank (the worst rank of the mesh)."""

    seconds: float
    state_bytes: int  # model state while this layout is the model's home (params, grads, optimizer)
    param_bytes: int  # the parameters alone: what a reallocated copy occupies
    transient_bytes: int  # activations, logits, KV cache while the MFC runs
    micro_batches: int
    source: str  # "roofline", "profile:<file>" or "profile:<file>+roofline"
    breakdown: tuple[tuple[str, float], ...] = ()

    @property
    def peak_memory_bytes(self) -> int:
        return self.state_bytes + self.transient_bytes

    def part(self, name: str) -> float:
        return dict(self.breakdown).get(name, 0.0)


@lru_cache(maxsize=4096)
def stage_param_elements(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> tuple[int, ...]:
    """Parameter elements the first TP rank (the largest chunk) of each pipeline stage holds (with ep: its
    ``1 / ep`` of the experts)."""
    strategy = Strategy(dp=ep, tp=tp, pp=pp, ep=ep)
    return tuple(shard_bytes(cfg, strategy, s, 0, 1, ep_rank=0) for s in range(pp))


@lru_cache(maxsize=4096)
def stage_expert_elements(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> tuple[int, ...]:
    """Of ``stage_param_elements``, those of experts (this rank's ``1 / ep`` of them): under ep they are
    reduced and partitioned over the expert-dp group instead of dp."""
    strategy = Strategy(dp=ep, tp=tp, pp=pp, ep=ep)
    return tuple(sum(s.numel for s in shard_specs(cfg, strategy, stage, 0, 0) if s.param.expert is not None)
                 for stage in range(pp))


def trained_zero_stage(zero_stage: int, ep: int) -> int:
    """The ZeRO stage a model trains with (``runtime.engines.effective_zero_stage``: ZeRO-0 runs as 1 under ep)."""
    return 1 if ep > 1 and zero_stage == 0 else zero_stage


def expert_exchange_seconds(cluster: ClusterSpec, cfg: ModelConfig, layout: Layout, tokens: float, e: int) -> float:
    """One pass of the most loaded stage's sparse layers over ``tokens`` tokens under ep: two all-to-alls each
    (to the experts and back), every rank sending ``tokens * hidden * top_k * bytes * (ep - 1) / ep``, over
    the ep group's link (intra- or inter-node by where the group sits). 0 without ep."""
    s = layout.strategy
    if s.ep == 1 or not cfg.is_moe:
        return 0.0
    sparse = max(sum(1 for i in range(lo, hi) if cfg.is_sparse(i)) for lo, hi in stage_layers(cfg, s.pp))
    rows = tokens * cfg.hidden_size * cfg.experts_per_token * e
    return sparse * 2 * alltoall_seconds(cluster, _worst_group(layout, "ep"), rows)


@lru_cache(maxsize=4096)
def stage_trained_elements(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> tuple[int, ...]:
    """Elements the first TP rank of each stage trains: all its parameters, or a LoRA model's adapters."""
    if cfg.lora is None:
        return stage_param_elements(cfg, tp, pp, ep)
    strategy = Strategy(dp=ep, tp=tp, pp=pp, ep=ep)
    return tuple(sum(s.numel for s in shard_specs(cfg, strategy, stage, 0, 0) if is_adapter(cfg, s.param.name))
                 for stage in range(pp))


def forward_workspace_elements_per_token(cfg: ModelConfig, tp: int) -> float:
    """Elements a forward without autograd holds live per token, about one block's worth: the inputs and outputs
    of the two norms, q, k, v and attention's output, the MLP's intermediates (what a training step keeps for its
    backward is ``activations.block_activation_bytes_per_token``)."""
    s = block_shape(cfg, tp)
    replicated = 4 * s.hidden
    sharded = 2 * s.q_out + 2 * s.kv_out + (3 if s.gated else 2) * s.inter
    return replicated + sharded


def _worst_group(layout: Layout, kind: str) -> tuple[int, ...]:
    groups = {"tp": layout.tp_groups, "dp": layout.dp_groups, "pp": layout.pp_groups, "ep": layout.ep_groups,
              "edp": layout.edp_groups}[kind]()
    return max(groups, key=lambda g: (len(g), g[-1] - g[0]))


def dp_size_ok(mfc: MFC, dp: int) -> bool:
    """Every DP rank needs at least one sequence per optimizer step (or per pass)."""
    steps = mfc.minibatches if mfc.kind == "train_step" else 1
    return mfc.n_seqs >= dp * steps


def sequences_per_rank(mfc: MFC, dp: int) -> float:
    """Sequences one DP rank handles per pass (train: per optimizer step)."""
    steps = mfc.minibatches if mfc.kind == "train_step" else 1
    return math.ceil(mfc.n_seqs / (dp * steps))


class Estimator:
    """Estimates MFCs for one cluster; ``compute_for(role)`` picks the profile or the roofline per model."""

    def __init__(self, cluster: ClusterSpec, use_profiles: bool = True, engine: GenerationEngine = RestageEngine()):
        """``engine``: what generate MFCs run on (restage's rollout engine with the config's settings)."""
        self.cluster = cluster
        self.use_profiles = use_profiles
        self.engine = engine
        self._compute: dict[tuple, RooflineCompute | ProfiledCompute] = {}
        self._cache: dict[tuple, Estimate] = {}

    def compute_for(self, role: ModelRole) -> RooflineCompute | ProfiledCompute:
        key = (role.arch, role.dtype)
        if key not in self._compute:
            roofline = RooflineCompute(self.cluster, role.arch, role.dtype)
            model: RooflineCompute | ProfiledCompute = roofline
            if self.use_profiles:
                profile = find_profile(self.cluster.name, role.arch, role.dtype)
                if profile is not None:
                    model = ProfiledCompute(profile, roofline)
            self._compute[key] = model
        return self._compute[key]

    def estimate(self, mfc: MFC, role: ModelRole, layout: Layout, micro_batches: int | None = None,
                 engine: GenerationEngine | None = None) -> Estimate:
        """Cost of ``mfc`` on ``layout``; ``micro_batches`` defaults to max(the MFC's, pp) (1 for a generation,
        whose engine batches by itself); a generation runs on ``engine``, default the estimator's."""
        s = layout.strategy
        m = 1 if mfc.kind == "generate" else (micro_batches or max(mfc.micro_batches, s.pp))
        engine = engine or self.engine
        links = tuple(bus_bandwidth(self.cluster, _worst_group(layout, k)) for k in ("tp", "dp", "pp", "ep"))
        # An MFC's options are not part of its hash; a generation's group size and multi-turn figures are part of its
        # cost.
        gen_key = (engine, int(mfc.options.get("group_size", 1)),
                   *(mfc.options.get(k) for k in ("turns", "observation_tokens", "tool_seconds"))
                   ) if mfc.kind == "generate" else None
        key = (mfc, role, s, m, links, gen_key)
        if key not in self._cache:
            self._cache[key] = self._estimate(mfc, role, layout, m, engine)
        return self._cache[key]

    def _estimate(self, mfc: MFC, role: ModelRole, layout: Layout, m: int, engine: GenerationEngine) -> Estimate:
        validate_strategy(role.arch, layout.strategy, role.name)
        compute = self.compute_for(role)
        if hasattr(compute, "used"):
            compute.used.clear()
        if mfc.kind == "generate":
            graphs = RooflineCompute(self.cluster, role.arch, role.dtype, launch_overhead_seconds=GRAPH_BLOCK_SECONDS)
            seconds, transient, parts = _generate(self.cluster, compute, graphs, mfc, role, layout, engine)
        else:
            kind = {"train_step": _train, "inference": _inference}[mfc.kind]
            seconds, transient, parts = kind(self.cluster, compute, mfc, role, layout, m)
        overhead = overhead_seconds(self.cluster, mfc, layout, m)
        if overhead:
            seconds += overhead
            parts["overhead_seconds"] = overhead
        source = compute.describe() if hasattr(compute, "describe") else compute.source
        params, trained, experts = _worst_stage(role.arch, layout.strategy)
        held = params / layout.strategy.dp if sharded_frozen(role, mfc) else params
        return Estimate(seconds=seconds, state_bytes=_state_bytes(role, mfc, params, trained, experts, layout.strategy),
                        param_bytes=int(held * role.bytes_per_element), transient_bytes=int(transient), micro_batches=m,
                        source=source, breakdown=tuple(sorted(parts.items())))


# The runtime's fixed host-side costs (``ClusterSpec.*_overhead_seconds``) and what each is paid per.
OVERHEADS = ("mfc", "sequence", "forward", "backward", "decode_step", "optimizer_step", "dp_step")


def overhead_counts(mfc: MFC, layout: Layout, m: int) -> dict[str, float]:
    """How many times one rank pays each fixed overhead in one call of ``mfc`` on ``layout`` with ``m`` micro-batches.

    Per-micro-batch costs count pipeline slots (``m + pp - 1``), like the compute they accompany;
    a generation pays its per-token cost once per decoding step (its prefill is one more
    forward). A train step pays per optimizer step, ``epochs x minibatches`` times, and once more per
    optimizer step (``dp_step``) when its gradients are reduced over data-parallel ranks.
    """
    s = layout.strategy
    slots = m + s.pp - 1
    seqs = math.ceil(mfc.n_seqs / s.dp)
    if mfc.kind == "generate":
        return {"mfc": 1, "sequence": seqs, "forward": 1, "decode_step": mfc.gen_tokens}
    if mfc.kind == "inference":
        return {"mfc": 1, "sequence": seqs, "forward": slots}
    steps = mfc.epochs * mfc.minibatches
    return {"mfc": 1, "sequence": seqs * mfc.epochs, "forward": steps * slots, "backward": steps * slots,
            "optimizer_step": steps, "dp_step": steps if s.dp > 1 else 0}


def overhead_seconds(cluster: ClusterSpec, mfc: MFC, layout: Layout, m: int) -> float:
    counts = overhead_counts(mfc, layout, m)
    return sum(n * getattr(cluster, f"{name}_overhead_seconds") for name, n in counts.items())


def _worst_stage(cfg: ModelConfig, s: Strategy) -> tuple[int, int, int]:
    """Of the largest stage's first TP rank: its parameter elements, those it trains (all, or a LoRA model's
    adapters) and, of those trained, the experts' (LoRA adapts no expert: ``sharding`` refuses it)."""
    params, trained = stage_param_elements(cfg, s.tp, s.pp, s.ep), stage_trained_elements(cfg, s.tp, s.pp, s.ep)
    experts = stage_expert_elements(cfg, s.tp, s.pp, s.ep) if cfg.lora is None else (0,) * s.pp
    stage = max(range(s.pp), key=lambda i: params[i])
    return params[stage], trained[stage], experts[stage]


def _partitioned(elements: int, experts: int, s: Strategy) -> float:
    """Elements of a ZeRO partition: shared ones split over dp, the experts' over their expert-dp group."""
    return (elements - experts) / s.dp + experts / (s.dp // s.ep)


def sharded_frozen(role: ModelRole, mfc: MFC) -> bool:
    """Whether ``mfc`` runs on a frozen model partitioned ZeRO-3 / FSDP style over its DP ranks."""
    return role.shard_frozen and not role.trainable and mfc.kind == "inference"


def _state_bytes(role: ModelRole, mfc: MFC, params: int, trained: int, experts: int, s: Strategy) -> int:
    """Parameters, and for a train step the gradients and optimizer state of the ``trained`` elements."""
    e = role.bytes_per_element
    if mfc.kind != "train_step":
        return int(params * e / s.dp) if sharded_frozen(role, mfc) else params * e
    z = trained_zero_stage(role.zero_stage, s.ep)
    param_bytes = 0 if (z == 3 and role.offload_params) else (_partitioned(params, experts, s) if z == 3 else params) * e
    trained_part = _partitioned(trained, experts, s)
    grad_bytes = (trained_part if z >= 2 else trained) * e
    optim_bytes = 0 if role.offload_optimizer else (trained_part if z >= 1 else trained) * _OPTIMIZER_BYTES[role.dtype]
    return int(param_bytes + grad_bytes + optim_bytes)


def _stage_seconds(layout: Layout, cfg: ModelConfig, per_block: float, first: float, last: float) -> float:
    """Time of the slowest pipeline stage given per-block, first-stage-extra and last-stage-extra seconds."""
    ranges = stage_layers(cfg, layout.strategy.pp)
    pp = len(ranges)
    return max((hi - lo) * per_block + (first if i == 0 else 0) + (last if i == pp - 1 else 0)
               for i, (lo, hi) in enumerate(ranges))


def _max_stage_layers(cfg: ModelConfig, pp: int) -> int:
    return max(hi - lo for lo, hi in stage_layers(cfg, pp))


def _train(cluster: ClusterSpec, compute, mfc: MFC, role: ModelRole, layout: Layout, m: int):
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    b = sequences_per_rank(mfc, s.dp) / m
    seq = mfc.seq_tokens
    tokens = b * seq
    tp_group, dp_group, pp_group = (_worst_group(layout, k) for k in ("tp", "dp", "pp"))
    recompute = role.gradient_checkpointing
    block = compute.block_forward(b, seq, s.tp, s.ep) * (2 if recompute else 1) + compute.block_backward(b, seq, s.tp, s.ep)
    head = compute.head_forward(tokens, s.tp) + compute.head_backward(tokens, s.tp)
    compute_s = _stage_seconds(layout, cfg, block, compute.embed_forward(tokens) * 3, head)
    layers = _max_stage_layers(cfg, s.pp)
    tp_s = layers * (6 if recompute else 4) * allreduce_seconds(cluster, tp_group, tokens * cfg.hidden_size * e)
    send_s = 2 * p2p_seconds(cluster, pp_group[0], pp_group[-1], tokens * cfg.hidden_size * e) if s.pp > 1 else 0.0
    params, trained, experts = _worst_stage(cfg, s)
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
               ((dp_group, trained - experts), (_worst_group(layout, "edp") if s.ep > 1 else dp_group, experts)))
    optim_s = compute.optimizer_step(_partitioned(trained, experts, s) if zero >= 1 else trained)
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
    return seconds, transient, parts


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


def _inference(cluster: ClusterSpec, compute, mfc: MFC, role: ModelRole, layout: Layout, m: int):
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    b = sequences_per_rank(mfc, s.dp) / m
    seq = mfc.seq_tokens
    tokens = b * seq
    tp_group, pp_group = _worst_group(layout, "tp"), _worst_group(layout, "pp")
    compute_s = _stage_seconds(layout, cfg, compute.block_forward(b, seq, s.tp, s.ep), compute.embed_forward(tokens),
                               compute.head_forward(tokens, s.tp))
    layers = _max_stage_layers(cfg, s.pp)
    tp_s = layers * 2 * allreduce_seconds(cluster, tp_group, tokens * cfg.hidden_size * e)
    send_s = p2p_seconds(cluster, pp_group[0], pp_group[-1], tokens * cfg.hidden_size * e) if s.pp > 1 else 0.0
    ep_s = expert_exchange_seconds(cluster, cfg, layout, tokens, e)
    exposed_gather_s = 0.0
    transient = _forward_workspace(cfg, s.tp, tokens, e) + 2 * tokens * block_shape(cfg, s.tp).head_out * LOGIT_BYTES
    if sharded_frozen(role, mfc):
        # Every forward all-gathers the stage's parameters layer by layer over dp. With prefetch (the peers' ZeRO-3
        # and FSDP) the next layer's gather runs while the current layer computes, so per micro-batch the gathers
        # cost only what exceeds the compute, plus the first layer's; restage's runtime gathers each unit when
        # its forward starts, so every gather adds to the compute.
        params = _worst_stage(cfg, s)[0]
        gather_s = allgather_seconds(cluster, _worst_group(layout, "dp"), params * e)
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
    return rounds * per_micro, transient, parts


def _forward_workspace(cfg: ModelConfig, tp: int, tokens: float, e: int) -> float:
    """Live activations of a forward without autograd: about one block's worth."""
    return forward_workspace_elements_per_token(cfg, tp) * tokens * e


def restage_occupancy(cluster: ClusterSpec, engine: RestageEngine, mfc: MFC, role: ModelRole,
                      layout: Layout) -> Occupancy:
    """How restage's rollout engine holds one DP rank's requests: a paged cache (``engines.paged_occupancy``; a
    multi-turn episode's observation tokens grow its cache as answer tokens do) or, ``generation.kv_cache:
    contiguous``, ``engines.restage_slots``' slots of prompt + gen tokens."""
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    kv_token_bytes = 2 * _max_stage_layers(cfg, s.pp) * block_shape(cfg, s.tp).kv_out * e
    weight_bytes = _worst_stage(cfg, s)[0] * e
    requests = int(sequences_per_rank(mfc, s.dp))
    observed = int(mfc.options.get("observation_tokens", 0))
    # generation.kv_cache=auto (None): paged where flash-attn's paged kernel serves, as rollout.flash_pages decides
    paged = engine.limits.paged if engine.limits.paged is not None else flash_decodes(cluster, engine, role.dtype)
    if not paged:
        live = restage_slots(cluster, engine, kv_token_bytes * (mfc.prompt_tokens + mfc.gen_tokens), weight_bytes,
                             requests)
        return Occupancy(live=live, cache_bytes=kv_token_bytes * (mfc.prompt_tokens + mfc.gen_tokens + observed) * live)
    return paged_occupancy(kv_budget_bytes(cluster, engine, weight_bytes), kv_token_bytes, mfc.prompt_tokens,
                           mfc.gen_tokens + observed, int(mfc.options.get("group_size", 1)), requests,
                           engine.limits.max_slots, block_tokens(cluster, engine, role.dtype))


def restage_live(cluster: ClusterSpec, engine: RestageEngine, mfc: MFC, role: ModelRole, layout: Layout) -> int:
    """Sequences the rollout engine decodes at once on one DP rank of ``layout`` (``restage_occupancy``)."""
    return restage_occupancy(cluster, engine, mfc, role, layout).live


def restage_decode_steps(occupancy: Occupancy, requests: int, gen_tokens: int) -> float:
    """Decode steps restage's rollout engine runs for ``requests`` answers: ``decode_rounds`` rounds of
    ``gen_tokens``, and the steps preempted requests had run, done again at the live batch's rate."""
    steps = decode_rounds(requests, occupancy.live) * gen_tokens
    return steps + occupancy.lost_steps / occupancy.live if occupancy.preempted else steps


def lockstep_forwards(cluster: ClusterSpec, engine: RestageEngine, mfc: MFC, role: ModelRole, layout: Layout) -> int:
    """Forwards one DP rank of restage's rollout engine runs for ``mfc`` in lockstep (ZeRO-3 generation in place,
    ``runtime/store/zero3_generation.py``): its decode steps (every answer ``gen_tokens`` long, ``restage_decode_steps``)
    and, per round of ``check_every_steps`` of them, one prefill or empty join (``rollout/engine.py``)."""
    b = int(sequences_per_rank(mfc, layout.strategy.dp))
    steps = math.ceil(restage_decode_steps(restage_occupancy(cluster, engine, mfc, role, layout), b, mfc.gen_tokens))
    return steps + math.ceil(steps / engine.limits.check_every_steps)


def _generate(cluster: ClusterSpec, compute, graph_compute: RooflineCompute, mfc: MFC, role: ModelRole,
              layout: Layout, engine: GenerationEngine):
    """A DP rank's requests on ``engine`` (``engines.py``): ``live`` of them decoding at once in
    ``decode_rounds`` rounds; ``graph_compute`` (``GRAPH_BLOCK_SECONDS`` a block instead of the eager launch
    time) costs the steps the runtime replays as CUDA graphs.

    Under pp the one-batch engine runs the live batch through the stages one after another, and so does
    restage's with ``pp_groups=1``; by default restage's engine keeps ``G = pp`` micro-groups of ``live / G``
    slots in flight (``rollout/pipelined.py``): at each of a token's ``G`` ticks every stage steps
    one group at once, so a token of every live slot costs ``G`` stage steps over ``live / G`` slots
    instead of ``pp`` over ``live``, with one hand-over of a group's hidden states per tick and the
    group's tokens broadcast over the pipeline per tick."""
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    b = int(sequences_per_rank(mfc, s.dp))
    prompt, gen = mfc.prompt_tokens, mfc.gen_tokens
    # Multi-turn episodes (algorithms/episode_sizes.py): observation tokens share the cache, later turns prefill.
    turns, observed = int(mfc.options.get("turns", 1)), int(mfc.options.get("observation_tokens", 0))
    tp_group, pp_group = _worst_group(layout, "tp"), _worst_group(layout, "pp")
    layers = _max_stage_layers(cfg, s.pp)
    hidden_bytes = cfg.hidden_size * e
    length = prompt + gen + observed
    window = min(length, cfg.sliding_window) if cfg.sliding_window else length
    kv_token_bytes = 2 * layers * block_shape(cfg, s.tp).kv_out * e  # one token's keys and values on the stage
    filled = prompt + (gen + observed + 1) / 2  # the average cache length while decoding
    gathered = 0  # positions a paged cache gathers per row and stage step for SDPA (none: read in place)
    match engine:
        case OneBatchEngine():  # every prompt prefilled whole (the head gives the first token), the batch held to the end
            live, prompts, prefix, head, graphs, checks = b, b, prompt, b, False, 0
            attended, groups = filled, 1
            occupancy = Occupancy(live=b, cache_bytes=kv_token_bytes * window * live)
        case RestageEngine():  # a group's prompt less its last token prefilled once, the siblings copy it
            occupancy = restage_occupancy(cluster, engine, mfc, role, layout)
            live = occupancy.live
            prompts, prefix, head = math.ceil(b / int(mfc.options.get("group_size", 1))), prompt - 1, 0
            groups = group_count(engine.limits.pp_groups, s.pp) if s.pp > 1 else 1
            graphs = replays_graphs(cluster, engine, cfg, s, groups)
            if occupancy.block_tokens and not paged_flash(cluster, engine, role.dtype):
                # One gather of each row's blocks up to the longest row (a graph: the whole slot; eagerly, in the
                # steady state some row is near its end), then SDPA over those positions.
                attended = length
                gathered = blocks_for(length, occupancy.block_tokens) * occupancy.block_tokens
            else:  # flash-attn reads each row's own length; SDPA on slots: a graph's over the whole slot, masked
                attended = length if graphs and not flash_decodes(cluster, engine, role.dtype) else filled
            checks = (math.ceil(restage_decode_steps(occupancy, b, gen) / engine.limits.check_every_steps)
                      if cluster.has_gpus else 0)
        case _:
            assert_never(engine)
    tokens = prompts * prefix
    # Prefill: a forward over the prompts, stage after stage (the one-batch engine's head on each last prompt token).
    prefill_stage = _stage_seconds(layout, cfg, compute.block_prefill(prompts, prefix, s.tp, s.ep) if prefix else 0.0,
                                   compute.embed_forward(tokens), compute.head_forward(head, s.tp) if head else 0.0)
    prefill_comm = layers * 2 * allreduce_seconds(cluster, tp_group, tokens * hidden_bytes) if tokens else 0.0
    prefill_send = p2p_seconds(cluster, pp_group[0], pp_group[-1], tokens * hidden_bytes) if s.pp > 1 and tokens else 0.0
    prefill_ep = s.pp * expert_exchange_seconds(cluster, cfg, layout, tokens, e)
    # A group's siblings copy the prompt's keys and values (read and written once each); in a paged cache only those
    # of its partial last block, the full ones being shared.
    copied = prefix % occupancy.block_tokens if occupancy.block_tokens else prefix
    copy = 2 * (b - prompts) * copied * kv_token_bytes / cluster.achievable_memory_bandwidth()
    prefill = s.pp * (prefill_stage + prefill_comm) + (s.pp - 1) * prefill_send + prefill_ep + copy
    turn_prefill = _turn_prefill_seconds(cluster, compute, layout, cfg, b * (turns - 1), filled, hidden_bytes)
    prefill += turn_prefill
    # A step (a token of every live slot): `calls` stage steps over `batch` slots each, back to back on a stage:
    # the live batch through all pp stages one after the other, or G micro-groups' ticks, every stage busy.
    calls, batch = (groups, math.ceil(live / groups)) if groups > 1 else (s.pp, live)
    def decode_stage_seconds(step_compute) -> float:
        return _stage_seconds(layout, cfg, step_compute.decode_block(batch, attended, s.tp, s.ep),
                              step_compute.embed_forward(batch), step_compute.head_forward(batch, s.tp))
    # A paged gather reads each row's own blocks (about the tokens it holds; the positions it does not hold read the
    # one scratch block, which stays in the L2 cache) and writes the whole span side by side for SDPA.
    gather = batch * (filled + gathered) * kv_token_bytes / cluster.achievable_memory_bandwidth() if gathered else 0.0
    decode_stage = decode_stage_seconds(graph_compute if graphs else compute) + gather
    # A call captures its bucket's graph once: a warm-up step and the capture, each as long as an eager step.
    capture = 2 * s.pp * (decode_stage_seconds(compute) + gather) if graphs else 0.0
    # Per stage call, two all-reduces per block; per step, the sampler gathers the full-vocabulary logits over
    # TP, the hidden states cross the stage boundaries, and the chosen tokens and their log-probabilities are
    # broadcast over TP (unless greedy) and over the pipeline (once a step, or once a tick for its group).
    chosen = 2 * batch * 8
    decode_comm = calls * layers * 2 * allreduce_seconds(cluster, tp_group, batch * hidden_bytes) + allgather_seconds(
        cluster, tp_group, live * cfg.vocab_size * LOGIT_BYTES) + (0 if mfc.greedy else 2 * broadcast_seconds(
            cluster, tp_group, 2 * live * 8)) + (calls if groups > 1 else 2) * broadcast_seconds(cluster, pp_group, chosen)
    hand_overs = groups if groups > 1 else s.pp - 1  # per tick the stages hand over at once; else pp - 1 in turn
    decode_send = hand_overs * p2p_seconds(cluster, pp_group[0], pp_group[-1], batch * hidden_bytes) if s.pp > 1 else 0.0
    decode_ep = s.pp * expert_exchange_seconds(cluster, cfg, layout, live, e)
    step = calls * decode_stage + decode_comm + decode_send + decode_ep
    host_checks = checks * HOST_CHECK_SECONDS
    tool = (turns - 1) * float(mfc.options.get("tool_seconds", 0.0))  # an episode's tool calls, one after another
    # Preempted requests (a paged cache's first wave, ``engines.paged_occupancy``): their decode steps again, at the
    # live batch's rate, and their prompts prefilled again.
    first_prefill = s.pp * (prefill_stage + prefill_comm) + (s.pp - 1) * prefill_send + prefill_ep
    preemption = (occupancy.lost_steps / live * step + occupancy.preempted / prompts * first_prefill
                  if occupancy.preempted else 0.0)
    seconds = batched_generate_seconds(prefill, step, b, live, gen) + host_checks + capture + tool + preemption
    steps = decode_rounds(b, live) * gen
    parts = {"prefill_seconds": prefill, "decode_seconds": steps * step,
             "compute_seconds": s.pp * prefill_stage + steps * calls * decode_stage,
             "tp_comm_seconds": s.pp * prefill_comm + steps * decode_comm,
             "pp_send_seconds": (s.pp - 1) * prefill_send + steps * decode_send, "ep_comm_seconds": prefill_ep + steps * decode_ep}
    parts.update({k: v for k, v in (("kv_copy_seconds", copy), ("host_check_seconds", host_checks),
                                    ("graph_capture_seconds", capture), ("turn_prefill_seconds", turn_prefill),
                                    ("tool_seconds", tool), ("kv_gather_seconds", steps * calls * gather),
                                    ("preemption_seconds", preemption)) if v})
    # Memory: the KV cache (slots of the whole length, or a paged cache's pool; ``Occupancy``), a paged gather's one
    # layer of keys and values, one admission's prefill workspace, the step's logits.
    gather_workspace = 2 * batch * gathered * block_shape(cfg, s.tp).kv_out * e
    transient = (occupancy.cache_bytes + gather_workspace + _forward_workspace(cfg, s.tp, min(prompts, live) * prefix, e)
                 + live * block_shape(cfg, s.tp).head_out * LOGIT_BYTES)
    return seconds, transient, parts


def _turn_prefill_seconds(cluster: ClusterSpec, compute, layout: Layout, cfg: ModelConfig, prefills: float,
                          context: float, hidden_bytes: int) -> float:
    """Multi-turn episodes: ``prefills`` later turns, each prefilling its whole context (about ``context`` tokens)
    stage after stage, with the TP all-reduces of those tokens."""
    if prefills <= 0:
        return 0.0
    s, seq = layout.strategy, max(1, round(context))
    stage = _stage_seconds(layout, cfg, compute.block_prefill(prefills, seq, s.tp, s.ep), compute.embed_forward(
        prefills * seq), 0.0)
    comm = _max_stage_layers(cfg, s.pp) * 2 * allreduce_seconds(cluster, _worst_group(layout, "tp"),
                                                               prefills * seq * hidden_bytes)
    return s.pp * (stage + comm)
