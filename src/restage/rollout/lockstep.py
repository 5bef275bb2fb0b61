"""Replicas that must run the same forwards: their lockstep group, and a forward's part with no work of one's own.

Under expert parallelism the dp replicas of an ep group exchange tokens in their sparse layers, so they step in
lockstep: each round is one check, one prefill forward (or an empty join) and ``check_every_steps`` decode forwards
(or joins), until no replica has work left. A module whose parameters DeepSpeed ZeRO-3 partitions (the actor
generating on its training layout, in ``runtime/store/zero3_generation.py``'s lockstep mode) gathers them over its
dp group in every forward, so its dp replicas step in the same lockstep; their join is a forward of one dummy
token, whose hooks gather what a real forward does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from restage.models.decoder import StageModule
from restage.models.moe import MoEMLP
from restage.models.packing import PackedBatch


def join_sparse_layers(module: StageModule) -> None:
    """Take part in one step of this stage's sparse layers with no tokens of our own (ep: peers may send us theirs)."""
    empty = torch.empty(0, module.cfg.hidden_size, dtype=module.dtype, device=next(module.parameters()).device)
    for block in module.layers.values():
        if isinstance(block.mlp, MoEMLP):
            block.mlp(empty)


def is_partitioned(module: StageModule) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions this module's parameters (its mark on them: ``ds_status``)."""
    return any(hasattr(p, "ds_status") for p in module.parameters())


def lockstep_group(module: StageModule) -> dist.ProcessGroup | None:
    """The group whose replicas must run the same forwards: the ep group under ep (sparse layers exchange tokens),
    the dp group of a ZeRO-3 partitioned module (every forward gathers its parameters over it); else None."""
    ctx = module.ctx
    if ctx.ep_size > 1:
        return ctx.ep_group
    if ctx.strategy.dp > 1 and is_partitioned(module):
        assert ctx.dp_group is not None, "a partitioned module's context needs its dp group"
        return ctx.dp_group
    return None


def join_forward(module: StageModule) -> None:
    """A forward of one dummy token (position 0, no cache) through this stage, its output dropped: under ZeRO-3 its
    hooks gather the stage's parameters as a real forward's do, so peers' gathers have every rank."""
    device = next(module.parameters()).device
    inputs = (torch.zeros(1, dtype=torch.int64, device=device) if module.ctx.is_first_stage
              else torch.zeros(1, module.cfg.hidden_size, dtype=module.dtype, device=device))
    module(inputs, PackedBatch.from_seqlens([1], device=device))


def join_step(module: StageModule) -> None:
    """One forward's part with no work of our own, in lockstep with the replicas of ``lockstep_group``."""
    if is_partitioned(module):
        join_forward(module)
    else:
        join_sparse_layers(module)


def peers_done(done: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every replica of ``group`` is done (one small all-reduce); ``done`` when there is no group."""
    if group is None:
        return done
    flag = torch.tensor([1 if done else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
