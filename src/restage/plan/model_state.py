"""Model state per rank: the parameter elements a layout puts on its fullest rank, and the bytes of parameters,
gradients and optimizer state a ZeRO stage, offloading, LoRA or a sharded frozen model leave there."""

from __future__ import annotations

from functools import lru_cache
from typing import assert_never

from restage.graph import MFC, MFCKind
from restage.layout import Strategy
from restage.models.arch import ModelConfig
from restage.models.sharding import is_adapter, shard_bytes, shard_specs
from restage.plan.roles import ModelRole

# Bytes per parameter of mixed-precision AdamW state: fp32 master copy, m and v. Plain fp32
# training keeps only m and v next to the parameters.
_OPTIMIZER_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}


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


@lru_cache(maxsize=4096)
def stage_trained_elements(cfg: ModelConfig, tp: int, pp: int, ep: int = 1) -> tuple[int, ...]:
    """Elements the first TP rank of each stage trains: all its parameters, or a LoRA model's adapters."""
    if cfg.lora is None:
        return stage_param_elements(cfg, tp, pp, ep)
    strategy = Strategy(dp=ep, tp=tp, pp=pp, ep=ep)
    return tuple(sum(s.numel for s in shard_specs(cfg, strategy, stage, 0, 0) if is_adapter(cfg, s.param.name))
                 for stage in range(pp))


def trained_zero_stage(zero_stage: int, ep: int) -> int:
    """The ZeRO stage a model trains with (``runtime.store.zero_engines.effective_zero_stage``: ZeRO-0 runs as 1 under ep)."""
    return 1 if ep > 1 and zero_stage == 0 else zero_stage


def worst_stage(cfg: ModelConfig, s: Strategy) -> tuple[int, int, int]:
    """Of the largest stage's first TP rank: its parameter elements, those it trains (all, or a LoRA model's
    adapters) and, of those trained, the experts' (LoRA adapts no expert: ``sharding`` refuses it)."""
    params, trained = stage_param_elements(cfg, s.tp, s.pp, s.ep), stage_trained_elements(cfg, s.tp, s.pp, s.ep)
    experts = stage_expert_elements(cfg, s.tp, s.pp, s.ep) if cfg.lora is None else (0,) * s.pp
    stage = max(range(s.pp), key=lambda i: params[i])
    return params[stage], trained[stage], experts[stage]


def partitioned_elements(elements: int, experts: int, s: Strategy) -> float:
    """Elements of a ZeRO partition: shared ones split over dp, the experts' over their expert-dp group."""
    return (elements - experts) / s.dp + experts / (s.dp // s.ep)


def sharded_frozen(role: ModelRole, mfc: MFC) -> bool:
    """Whether ``mfc`` runs on a frozen model partitioned ZeRO-3 / FSDP style over its DP ranks."""
    return role.shard_frozen and not role.trainable and mfc.kind is MFCKind.INFERENCE


def state_bytes(role: ModelRole, mfc: MFC, params: int, trained: int, experts: int, s: Strategy) -> int:
    """Parameters, and for a train step the gradients and optimizer state of the ``trained`` elements."""
    match mfc.kind:
        case MFCKind.GENERATE | MFCKind.INFERENCE:
            e = role.bytes_per_element
            return int(params * e / s.dp) if sharded_frozen(role, mfc) else params * e
        case MFCKind.TRAIN_STEP:
            return _training_state_bytes(role, params, trained, experts, s)
        case _:
            assert_never(mfc.kind)


def _training_state_bytes(role: ModelRole, params: int, trained: int, experts: int, s: Strategy) -> int:
    """A trained model's parameters, gradients and optimizer state per its ZeRO stage and offloads."""
    e = role.bytes_per_element
    z = trained_zero_stage(role.zero_stage, s.ep)
    param_bytes = 0 if (z == 3 and role.offload_params) else (partitioned_elements(params, experts, s) if z == 3 else params) * e
    trained_part = partitioned_elements(trained, experts, s)
    grad_bytes = (trained_part if z >= 2 else trained) * e
    optim_bytes = 0 if role.offload_optimizer else (trained_part if z >= 1 else trained) * _OPTIMIZER_BYTES[role.dtype]
    return int(param_bytes + grad_bytes + optim_bytes)
