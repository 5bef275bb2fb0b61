"""How a decoder is sharded: canonical parameter names, their TP split and their PP stage.

This is the one contract the decoder, the HF adapter, parameter reallocation and the memory
estimator share. Parameters use canonical names (``layers.3.attn.q.weight``) with weights in
``[out, in]`` order and q, k, v separate; ``models/hf_adapter.py`` maps HF names to these.

TP: column-parallel weights split dim 0, row-parallel weights split dim 1, the embedding and
LM head split the vocabulary (dim 0). Head dimensions split by whole heads (tp must divide the
head and KV-head counts); the vocabulary and the MLP width split into near-equal contiguous
chunks (the first ``n % tp`` chunks one larger), so any tp works for them.

PP: contiguous layer ranges balanced by parameter count, stage 0 also holding the embeddings
and the last stage the final norm and head. With tied embeddings and pp > 1 the last stage
holds its own copy of ``embed.weight`` (gradients are summed over the two copies).

EP (mixture-of-experts models): each expert's weights (``layers.3.mlp.experts.5.up.weight``) are
held only by the ep-rank that owns the expert, ``e // (E / ep)``, TP-split inside as a dense MLP;
the router and everything else are held by every ep-rank (``layout.py`` says where ep sits).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache
from typing import assert_never

from restage.errors import LayoutError
from restage.layout import Coord, Strategy
from restage.models.arch import ModelConfig

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


class Place(StrEnum):
    """Where a parameter sits in the forward: its pipeline stage follows from this."""

    FIRST = "first"  # the embeddings, on stage 0
    LAYER = "layer"  # a block's, on the stage holding the block
    LAST = "last"  # the final norm and head, on the last stage


@dataclass(frozen=True)
class ParamSpec:
    """One full (unsharded) parameter."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None  # None: replicated over TP
    unit: int  # split granularity along split_dim (head_dim for head-sharded dims, else 1)
    layer: int | None  # transformer block index, None for embeddings / final norm / head
    where: Place

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def expert(self) -> int | None:
        """The expert this parameter belongs to (``layers.3.mlp.experts.5.up.weight`` -> 5), None if shared."""
        found = _EXPERT.search(self.name)
        return None if found is None else int(found.group(1))


@dataclass(frozen=True)
class ShardSpec:
    """The piece of one parameter a (pp stage, tp rank) holds: ``[start, stop)`` along ``split_dim``."""

    param: ParamSpec
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        if self.param.split_dim is None:
            return self.param.shape
        shape = list(self.param.shape)
        shape[self.param.split_dim] = self.stop - self.start
        return tuple(shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def index(self) -> tuple[slice, ...]:
        """Index into the full tensor that selects this shard."""
        if self.param.split_dim is None:
            return tuple(slice(None) for _ in self.param.shape)
        return tuple(
            slice(self.start, self.stop) if d == self.param.split_dim else slice(None)
            for d in range(len(self.param.shape))
        )


def param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Every parameter of the model in canonical order."""
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    family = cfg.traits
    specs = [ParamSpec("embed.weight", (cfg.vocab_size, h), 0, 1, None, Place.FIRST)]
    match family.positions:
        case "learned":
            specs.append(ParamSpec("pos_embed.weight", (cfg.max_positions, h), None, 1, None, Place.FIRST))
        case "rope":
            pass
        case unknown:
            assert_never(unknown)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."

        def add(name: str, shape: tuple[int, ...], split_dim: int | None, unit: int = 1, _p: str = p,
                _i: int = i) -> None:
            specs.append(ParamSpec(_p + name, shape, split_dim, unit, _i, Place.LAYER))

        add("attn_norm.weight", (h,), None)
        if family.norm_bias:
            add("attn_norm.bias", (h,), None)
        for proj, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            add(f"attn.{proj}.weight", (out, h), 0, hd)
            if cfg.qkv_bias:
                add(f"attn.{proj}.bias", (out,), 0, hd)
        add("attn.o.weight", (h, q_out), 1, hd)
        if cfg.o_bias:
            add("attn.o.bias", (h,), None)
        if cfg.qk_norm:  # per-head norms (Qwen3): every TP rank holds them whole
            add("attn.q_norm.weight", (hd,), None)
            add("attn.k_norm.weight", (hd,), None)
        add("mlp_norm.weight", (h,), None)
        if family.norm_bias:
            add("mlp_norm.bias", (h,), None)
        if cfg.is_sparse(i):
            # The router is replicated; each expert is split over TP like a dense MLP and stays a
            # parameter of its own, so a later expert-parallel split is a partition of whole experts.
            add("mlp.router.weight", (cfg.num_experts, h), None)
            moe = cfg.moe_intermediate_size
            for e in range(cfg.num_experts):
                add(f"mlp.experts.{e}.gate.weight", (moe, h), 0)
                add(f"mlp.experts.{e}.up.weight", (moe, h), 0)
                add(f"mlp.experts.{e}.down.weight", (h, moe), 1)
            continue
        if family.gated_mlp:
            add("mlp.gate.weight", (inter, h), 0)
        add("mlp.up.weight", (inter, h), 0)
        if family.mlp_bias:
            add("mlp.up.bias", (inter,), 0)
        add("mlp.down.weight", (h, inter), 1)
        if family.mlp_bias:
            add("mlp.down.bias", (h,), None)
    specs.append(ParamSpec("final_norm.weight", (h,), None, 1, None, Place.LAST))
    if family.norm_bias:
        specs.append(ParamSpec("final_norm.bias", (h,), None, 1, None, Place.LAST))
    if cfg.is_critic:
        specs.append(ParamSpec("score.weight", (1, h), None, 1, None, Place.LAST))
    elif not cfg.tied_embeddings:
        specs.append(ParamSpec("lm_head.weight", (cfg.vocab_size, h), 0, 1, None, Place.LAST))
    return _with_lora(cfg, specs) if cfg.lora is not None else specs


# LoRA target (canonical module name) -> the module path inside a block.
LORA_TARGETS = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o", "gate": "mlp.gate", "up": "mlp.up",
                "down": "mlp.down"}


def _with_lora(cfg: ModelConfig, specs: list[ParamSpec]) -> list[ParamSpec]:
    """``specs`` with ``<module>.lora_A.weight`` ``[r, in]`` and ``<module>.lora_B.weight`` ``[out, r]`` after each
    targeted weight. A column-parallel base (split dim 0) gives a replicated A and a B split like the base; a
    row-parallel one (split dim 1) an A split like the base and a replicated B: each rank's A and B then multiply
    exactly the slice of the activations its base shard sees."""
    assert cfg.lora is not None  # only called for a LoRA model
    rank = cfg.lora.rank
    targets = {LORA_TARGETS[t] for t in cfg.lora.target_modules}
    out = []
    for spec in specs:
        out.append(spec)
        module = spec.name.split(".", 2)[-1].removesuffix(".weight") if spec.where is Place.LAYER else ""
        if module not in targets or not spec.name.endswith(".weight"):
            continue
        prefix = spec.name.removesuffix("weight")
        out_features, in_features = spec.shape
        column = spec.split_dim == 0
        out.append(ParamSpec(prefix + "lora_A.weight", (rank, in_features), None if column else 1,
                             1 if column else spec.unit, spec.layer, Place.LAYER))
        out.append(ParamSpec(prefix + "lora_B.weight", (out_features, rank), 0 if column else None,
                             spec.unit if column else 1, spec.layer, Place.LAYER))
    return out


def is_adapter(cfg: ModelConfig, name: str) -> bool:
    """Whether a parameter is trained in a LoRA model: its adapters, and a critic's fresh scalar head."""
    return cfg.lora is not None and (".lora_A." in name or ".lora_B." in name or name == "score.weight")


def num_experts(cfg: ModelConfig) -> int:
    """Experts per mixture-of-experts layer; 0 for a dense model."""
    return cfg.num_experts if cfg.is_moe else 0


def expert_owner(cfg: ModelConfig, ep: int, expert: int) -> int:
    """The ep-rank that holds ``expert`` when the experts are split over ``ep`` ranks."""
    return expert // (num_experts(cfg) // ep)


def ep_problem(cfg: ModelConfig, strategy: Strategy, name: str = "model") -> str | None:
    """Why the model cannot split its experts ep ways (what to change), or None if it can."""
    ep, experts = strategy.ep, num_experts(cfg)
    if ep == 1:
        return None
    if experts == 0:
        return f"{name}: ep={ep} needs a mixture-of-experts model and this one is dense; use ep=1"
    if experts % ep:
        ok = [e for e in range(1, experts + 1) if experts % e == 0 and strategy.dp % e == 0]
        return f"{name}: ep={ep} does not divide its {experts} experts; use ep in {ok}"
    return None


def strategy_problem(cfg: ModelConfig, strategy: Strategy, name: str = "model") -> str | None:
    """Why the model cannot be sharded with this tp / pp / ep (what to change), or None if it can."""
    tp, pp = strategy.tp, strategy.pp
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        ok = [t for t in range(1, cfg.num_heads + 1) if cfg.num_heads % t == 0 and cfg.num_kv_heads % t == 0]
        return (f"{name}: tp={tp} does not divide {cfg.num_heads} attention heads and {cfg.num_kv_heads} "
                f"KV heads; use tp in {ok}")
    if pp > cfg.num_layers:
        return f"{name}: pp={pp} is larger than its {cfg.num_layers} layers; use pp <= {cfg.num_layers}"
    if tp > cfg.vocab_size or tp > cfg.intermediate_size:
        return f"{name}: tp={tp} exceeds the vocabulary or MLP width"
    if cfg.is_moe and tp > cfg.moe_intermediate_size:
        return f"{name}: tp={tp} exceeds the experts' MLP width {cfg.moe_intermediate_size}; use tp <= {cfg.moe_intermediate_size}"
    return ep_problem(cfg, strategy, name)


def validate_strategy(cfg: ModelConfig, strategy: Strategy, name: str = "model") -> None:
    """Raise LayoutError, saying what to change, if the model cannot take this tp / pp."""
    problem = strategy_problem(cfg, strategy, name)
    if problem:
        raise LayoutError(problem)


def training_layout_problem(name: str, cfg: ModelConfig, zero_stage: int, strategy: Strategy, mesh_size: int,
                            world_size: int) -> str | None:
    """Why a trained model cannot train in this layout (what to change), or None if it can (see ``layout_problem``)."""
    if zero_stage == 3 and mesh_size != world_size:
        # DeepSpeed 0.19's ZeRO-3 synchronises the whole world while setting up and while
        # fetching parameters, which deadlocks when other ranks run other models meanwhile.
        return (f"models.{name}: zero_stage=3 needs its training layout to span all {world_size} ranks (it spans "
                f"{mesh_size}); use zero_stage 1 or 2")
    if cfg.tied_embeddings and strategy.pp > 1:
        # The two copies' gradients would have to be summed inside DeepSpeed's reduction.
        return (f"models.{name}: training a model with tied embeddings under pp={strategy.pp} is not supported; "
                "train it with pp=1 (tp and dp are fine)")
    if strategy.ep > 1 and zero_stage == 3:
        # The engine trains experts with DeepSpeed's MoE groups (runtime/store/expert_engine.py), which ZeRO-3 refuses.
        return (f"models.{name}: training under ep={strategy.ep} needs zero_stage 0, 1 or 2 (DeepSpeed's ZeRO-3 "
                "takes no expert groups); set zero_stage=2 or train with ep=1")
    return None


def layout_problem(name: str, cfg: ModelConfig, strategy: Strategy, world_size: int, *, trained: bool = False,
                   zero_stage: int = 0) -> str | None:
    """Why the runtime refuses to hold model ``name`` (and, if ``trained``, to train it) in a layout with this
    strategy in a world of ``world_size`` ranks (what to change), or None if it takes it.

    The one feasibility rule: the planner proposes no layout it refuses (``plan.problem.strategies_for``, the
    candidates, the search's starting plans and manual layouts) and the runtime checks every layout of a
    schedule with it at start-up (``runtime.store.feasibility.schedule_problem``). Placement (which ranks) does not
    matter to it; a layout's mesh is as large as its strategy.
    """
    problem = strategy_problem(cfg, strategy, f"models.{name}")
    if problem is None and trained:
        problem = training_layout_problem(name, cfg, zero_stage, strategy, strategy.world_size, world_size)
    return problem


def split_range(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``total`` (in multiples of ``unit``) is cut into ``parts``."""
    units, rem = divmod(total // unit, parts)
    start = index * units + min(index, rem)
    stop = start + units + (1 if index < rem else 0)
    return start * unit, stop * unit


@lru_cache(maxsize=256)
def stage_layers(cfg: ModelConfig, pp: int) -> tuple[tuple[int, int], ...]:
    """Layer ranges ``[start, stop)`` of each pipeline stage, minimising the largest stage's parameters.

    Stage 0 also carries the embeddings and the last stage the final norm and head, so on
    small models they get fewer layers. Every stage gets at least one layer.
    """
    if pp > cfg.num_layers:
        validate_strategy(cfg, Strategy(tp=1, pp=pp))
    specs = param_specs(cfg)
    per_layer = [0] * cfg.num_layers  # a MoE model's dense and sparse layers differ
    for spec in specs:
        if spec.layer is not None:
            per_layer[spec.layer] += spec.numel
    before = [0]
    for count in per_layer:
        before.append(before[-1] + count)
    first = sum(s.numel for s in specs if s.where is Place.FIRST)
    last = sum(s.numel for s in specs if s.where is Place.LAST)
    if cfg.tied_embeddings and pp > 1:
        last += cfg.vocab_size * cfg.hidden_size
    n = cfg.num_layers

    def cost(stage: int, start: int, count: int) -> int:
        layers = before[start + count] - before[start]
        return layers + (first if stage == 0 else 0) + (last if stage == pp - 1 else 0)

    # Exact minimax contiguous partition by dynamic programming: best[s][k] is the smallest
    # achievable maximum stage cost when stages s.. hold the last k layers.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    choice = [[0] * (n + 1) for _ in range(pp + 1)]
    best[pp][0] = 0
    for s in range(pp - 1, -1, -1):
        for k in range(1, n + 1):
            for take in range(1, k - (pp - 1 - s) + 1):
                value = max(cost(s, n - k, take), best[s + 1][k - take])
                if value < best[s][k]:
                    best[s][k], choice[s][k] = value, take
    ranges, start, left = [], 0, n
    for s in range(pp):
        take = choice[s][left]
        ranges.append((start, start + take))
        start, left = start + take, left - take
    return tuple(ranges)


def unit_of(cfg: ModelConfig, spec: ParamSpec) -> int:
    """The unit a parameter belongs to, numbered in forward order: 0 the embeddings, 1 + i layer i, num_layers + 1
    the final norm and head. A ZeRO-3 model is gathered one unit at a time (reallocation, the HF export)."""
    match spec.where:
        case Place.FIRST:
            return 0
        case Place.LAYER:
            assert spec.layer is not None  # param_specs gives every layer parameter its block index
            return 1 + spec.layer
        case Place.LAST:
            return cfg.num_layers + 1
        case unknown:
            assert_never(unknown)


def stage_params(cfg: ModelConfig, pp: int, stage: int) -> list[ParamSpec]:
    """The full parameters whose shards live on pipeline stage ``stage``."""
    lo, hi = stage_layers(cfg, pp)[stage]
    out = []
    for spec in param_specs(cfg):
        match spec.where:
            case Place.LAYER:
                assert spec.layer is not None  # a layer parameter names its layer
                keep = lo <= spec.layer < hi
            case Place.FIRST:
                keep = stage == 0
            case Place.LAST:
                keep = stage == pp - 1
            case unknown:
                assert_never(unknown)
        if keep:
            out.append(spec)
    if cfg.tied_embeddings and not cfg.is_critic and stage == pp - 1 and pp > 1:
        out.append(next(s for s in param_specs(cfg) if s.name == "embed.weight"))
    return out


def shard_specs(cfg: ModelConfig, strategy: Strategy, pp_stage: int, tp_rank: int,
                ep_rank: int | None = None) -> list[ShardSpec]:
    """What the rank at (pp_stage, tp_rank) of a layout with this strategy holds, in canonical order.

    With ep > 1 ``ep_rank`` (``strategy.ep_rank(dp index)``) must be given: only its experts are held.
    """
    validate_strategy(cfg, strategy)
    if strategy.ep > 1 and ep_rank is None:
        raise ValueError(f"{strategy} splits experts: name the ep_rank whose shards you want")
    out = []
    for spec in stage_params(cfg, strategy.pp, pp_stage):
        expert = spec.expert
        if expert is not None and strategy.ep > 1 and expert_owner(cfg, strategy.ep, expert) != ep_rank:
            continue
        if spec.split_dim is None or strategy.tp == 1:
            out.append(ShardSpec(spec, 0, spec.shape[spec.split_dim or 0]))
        else:
            start, stop = split_range(spec.shape[spec.split_dim], strategy.tp, tp_rank, spec.unit)
            out.append(ShardSpec(spec, start, stop))
    return out


def coord_shard_specs(cfg: ModelConfig, strategy: Strategy, coord: Coord) -> list[ShardSpec]:
    """What the rank at ``coord`` of a layout with this strategy holds (its pp stage, tp rank and ep-rank)."""
    return shard_specs(cfg, strategy, coord.pp, coord.tp, strategy.ep_rank(coord.dp))


def shard_bytes(cfg: ModelConfig, strategy: Strategy, pp_stage: int, tp_rank: int, bytes_per_element: int,
                ep_rank: int = 0) -> int:
    """Bytes of parameters one rank holds."""
    return sum(s.numel for s in shard_specs(cfg, strategy, pp_stage, tp_rank, ep_rank)) * bytes_per_element
