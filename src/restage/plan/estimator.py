"""Time and peak memory per rank of one MFC under one layout.

Time: compute of the bottleneck pipeline stage (``compute.py``: roofline or profile), TP
all-reduces (two per block per pass), the 1F1B pipeline's fill and drain plus stage-to-stage
sends, ZeRO's gradient reduction / parameter gathering over the DP group, the optimizer step,
and generation on restage's rollout engine (``generation_cost.py``: slots, refill, one prefill per prompt group,
CUDA graphs where the runtime replays them) or, for a peer that generates so, one batch decoded to the end. Collectives are not
assumed to overlap with compute. Memory per rank: parameters, gradients and optimizer states
per ZeRO stage (``state_bytes``, held while the layout is the model's home; for a LoRA model gradients and
optimizer state only of the adapters), and what exists only
while the MFC runs (``transient_bytes``): activations (what every block saves for its backward,
``activations.py``, or with recomputation only block inputs), logits, the KV cache.

Every number is for the worst pipeline stage and the largest TP chunk, so one figure holds for
every rank of the mesh.

This file dispatches by MFC kind and caches; the parts live apart: ``pass_cost.py`` (train steps and forwards),
``rollout_cost.py`` (generation), ``model_state.py`` (parameters, gradients, optimizer state per rank),
``layout_cost.py`` (groups, stages, per-rank batches), ``roles.py`` (``ModelRole``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, assert_never, get_args

from restage.cluster import ClusterSpec
from restage.graph import MFC, MFCKind
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.sharding import validate_strategy
from restage.plan.compute import ProfiledCompute, RooflineCompute
from restage.plan.generation_cost import GRAPH_BLOCK_SECONDS, GenerationEngine, RestageEngine
from restage.plan.layout_cost import GroupKind, worst_group
from restage.plan.model_state import (
    sharded_frozen,
    state_bytes,
    worst_stage,
)
from restage.plan.nccl import bus_bandwidth
from restage.plan.pass_cost import inference_cost, train_cost
from restage.plan.profile import find_profile
from restage.plan.roles import ModelRole
from restage.plan.rollout_cost import generate_cost

# The groups whose slowest links an estimate depends on (part of its cache key).
_LINK_GROUPS: tuple[GroupKind, ...] = ("tp", "dp", "pp", "ep")


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


class Estimator:
    """Estimates MFCs for one cluster; ``compute_for(role)`` picks the profile or the roofline per model."""

    def __init__(self, cluster: ClusterSpec, use_profiles: bool = True, engine: GenerationEngine = RestageEngine(),
                 sequence_parallel: bool = False):
        """``engine``: what generate MFCs run on (restage's rollout engine with the config's settings);
        ``sequence_parallel``: cost TP as Megatron and torchtitan run it (``RooflineCompute``), for modelling those
        systems (``bench/validation.py``); restage's own plans leave it off."""
        self.cluster = cluster
        self.sequence_parallel = sequence_parallel
        self.use_profiles = use_profiles
        self.engine = engine
        self._compute: dict[tuple[ModelConfig, str], RooflineCompute | ProfiledCompute] = {}
        self._cache: dict[tuple[object, ...], Estimate] = {}

    def compute_for(self, role: ModelRole) -> RooflineCompute | ProfiledCompute:
        """The profile measured for the role's architecture and dtype on this cluster, else the roofline."""
        key = (role.arch, role.dtype)
        if key not in self._compute:
            roofline = RooflineCompute(self.cluster, role.arch, role.dtype, sequence_parallel=self.sequence_parallel)
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
        engine = engine or self.engine
        gen_key: tuple[object, ...] | None
        match mfc.kind:
            case MFCKind.GENERATE:
                m = 1
                # An MFC's options are not part of its hash; a generation's group size and multi-turn figures are
                # part of its cost.
                gen_key = (engine, mfc.options.group, mfc.options.episodes)
            case MFCKind.INFERENCE | MFCKind.TRAIN_STEP:
                m = micro_batches or max(mfc.micro_batches, s.pp)
                gen_key = None
            case _:
                assert_never(mfc.kind)
        links = tuple(bus_bandwidth(self.cluster, worst_group(layout, k)) for k in _LINK_GROUPS)
        key = (mfc, role, s, m, links, gen_key)
        if key not in self._cache:
            self._cache[key] = self._estimate(mfc, role, layout, m, engine)
        return self._cache[key]

    def _estimate(self, mfc: MFC, role: ModelRole, layout: Layout, m: int, engine: GenerationEngine) -> Estimate:
        validate_strategy(role.arch, layout.strategy, role.name)
        compute = self.compute_for(role)
        compute.begin_estimate()
        match mfc.kind:
            case MFCKind.GENERATE:
                graphs = RooflineCompute(self.cluster, role.arch, role.dtype, launch_overhead_seconds=GRAPH_BLOCK_SECONDS)
                cost = generate_cost(self.cluster, compute, graphs, mfc, role, layout, engine)
            case MFCKind.INFERENCE:
                cost = inference_cost(self.cluster, compute, mfc, role, layout, m)
            case MFCKind.TRAIN_STEP:
                cost = train_cost(self.cluster, compute, mfc, role, layout, m)
            case _:
                assert_never(mfc.kind)
        seconds, transient, parts = cost
        overhead = overhead_seconds(self.cluster, mfc, layout, m)
        if overhead:
            seconds += overhead
            parts["overhead_seconds"] = overhead
        params, trained, experts = worst_stage(role.arch, layout.strategy)
        held = params / layout.strategy.dp if sharded_frozen(role, mfc) else params
        return Estimate(seconds=seconds, state_bytes=state_bytes(role, mfc, params, trained, experts, layout.strategy),
                        param_bytes=int(held * role.bytes_per_element), transient_bytes=int(transient), micro_batches=m,
                        source=compute.describe(), breakdown=tuple(sorted(parts.items())))


# The runtime's fixed host-side costs (``ClusterSpec.*_overhead_seconds``) and what each is paid per.
Overhead = Literal["mfc", "sequence", "forward", "backward", "decode_step", "optimizer_step", "dp_step"]
OVERHEADS: tuple[Overhead, ...] = get_args(Overhead)


def overhead_counts(mfc: MFC, layout: Layout, m: int) -> dict[Overhead, float]:
    """How many times one rank pays each fixed overhead in one call of ``mfc`` on ``layout`` with ``m`` micro-batches.

    Per-micro-batch costs count pipeline slots (``m + pp - 1``), like the compute they accompany;
    a generation pays its per-token cost once per decoding step (its prefill is one more
    forward). A train step pays per optimizer step, ``epochs x minibatches`` times, and once more per
    optimizer step (``dp_step``) when its gradients are reduced over data-parallel ranks.
    """
    s = layout.strategy
    slots = m + s.pp - 1
    seqs = math.ceil(mfc.n_seqs / s.dp)
    match mfc.kind:
        case MFCKind.GENERATE:
            return {"mfc": 1, "sequence": seqs, "forward": 1, "decode_step": mfc.gen_tokens}
        case MFCKind.INFERENCE:
            return {"mfc": 1, "sequence": seqs, "forward": slots}
        case MFCKind.TRAIN_STEP:
            steps = mfc.epochs * mfc.minibatches
            return {"mfc": 1, "sequence": seqs * mfc.epochs, "forward": steps * slots, "backward": steps * slots,
                    "optimizer_step": steps, "dp_step": steps if s.dp > 1 else 0}
        case _:
            assert_never(mfc.kind)


def overhead_unit_seconds(cluster: ClusterSpec, overhead: Overhead) -> float:
    """Seconds one payment of ``overhead`` costs on ``cluster``."""
    match overhead:
        case "mfc":
            return cluster.mfc_overhead_seconds
        case "sequence":
            return cluster.sequence_overhead_seconds
        case "forward":
            return cluster.forward_overhead_seconds
        case "backward":
            return cluster.backward_overhead_seconds
        case "decode_step":
            return cluster.decode_step_overhead_seconds
        case "optimizer_step":
            return cluster.optimizer_step_overhead_seconds
        case "dp_step":
            return cluster.dp_step_overhead_seconds
        case _:
            assert_never(overhead)


def overhead_seconds(cluster: ClusterSpec, mfc: MFC, layout: Layout, m: int) -> float:
    """The fixed host-side seconds one rank pays in one call of ``mfc`` (``overhead_counts``)."""
    counts = overhead_counts(mfc, layout, m)
    return sum(n * overhead_unit_seconds(cluster, name) for name, n in counts.items())
