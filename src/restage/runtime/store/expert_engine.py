"""Training under expert parallelism with DeepSpeed's own MoE machinery, over restage's ep and expert-dp groups.

Under ep the ranks of one dp group hold different experts at the same place of the module, so a
DeepSpeed engine that treated every parameter alike would average expert 0's gradient with
expert 2's, partition their optimizer state over ranks that do not hold them, and save only dp
rank 0's experts. DeepSpeed already knows this case: a parameter marked ``allreduce = False``
with a ``group_name`` is an expert parameter, and ZeRO-1/2 then reduce-scatter its gradient over
``groups._EXPERT_DATA_PARALLEL_GROUP[group_name]`` (divided by the whole dp size, as
``models.expert_parallel.average_gradients`` does), partition its optimizer state over that group,
and count it once in the gradient norm (``get_grad_norm_direct`` sums over all of dp, where each
expert's shard lives exactly once). We register restage's own ep and expert-dp groups under a
name made of their ranks, so DeepSpeed's groups are restage's layout and never DeepSpeed's own
guess at one (two models on different layouts get different names).

Why this and not reducing expert gradients ourselves outside the engine: the engine's optimizer,
its partitions, its clipping norm, loss scaling and checkpoint files then all see the same groups,
with no second optimizer to keep in step. Why ZeRO-1/2 only: DeepSpeed's ZeRO-0 norm
(``runtime.utils.clip_grad_norm_``) averages each rank's norm over dp, which is not the global norm
when ranks hold different experts, so a ZeRO-0 model trains as ZeRO-1 under ep
(``engines.effective_zero_stage``: the same arithmetic, optimizer state partitioned); ZeRO-3 refuses
MoE parameters (``models.sharding.training_layout_problem`` says so in one line).

Checkpoints: DeepSpeed's MoE checkpoint format needs its own ``MoE`` modules, so the engine keeps its
plain format (``engine.has_moe_layers`` is cleared once the optimizer is built): optimizer files are
per dp rank already; the module file is written once per ep-rank (by the first replica holding
those experts) with the ep-rank in its name, and each rank reads its own ep-rank's file back.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from restage.layout import Layout, ProcessGroups

Engine = Any  # a DeepSpeedEngine: DeepSpeed ships no type information


def group_name(layout: Layout, rank: int) -> str:
    """The name this rank's ep and expert-dp groups go by in DeepSpeed's group registry."""
    ep, edp = layout.group_of(rank, "ep"), layout.group_of(rank, "edp")
    return f"restage_ep_{'-'.join(map(str, ep))}_edp_{'-'.join(map(str, edp))}"


def register_groups(layout: Layout, rank: int, groups: ProcessGroups) -> str:
    """Put this rank's ep and expert-dp groups in DeepSpeed's registry; returns their name."""
    # lazy: DeepSpeed takes seconds to import; only where an engine is built
    from deepspeed.utils import groups as ds_groups

    name = group_name(layout, rank)
    for kind, registry, ranks_registry in (
            ("ep", ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_PARALLEL_GROUP_RANKS),
            ("edp", ds_groups._EXPERT_DATA_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS)):
        ranks = layout.group_of(rank, kind)
        group = groups.get(ranks)
        if group is None:
            raise ValueError(f"no process group over {ranks}; build ProcessGroups(..., singletons=True)")
        registry[name] = group
        ranks_registry[name] = list(ranks)
    return name


def mark_expert_params(module: torch.nn.Module, name: str) -> int:
    """DeepSpeed's mark of an expert parameter (``deepspeed.moe.utils.is_moe_param``); returns how many were marked."""
    marked = 0
    for param_name, param in module.named_parameters():
        if ".experts." in param_name:
            param.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's own marks on a Parameter
            param.group_name = name  # type: ignore[attr-defined]
            marked += 1
    return marked


@contextlib.contextmanager
def moe_layers_seen() -> Iterator[None]:
    """Make the engine being built see restage's ``MoEMLP`` as a MoE layer (``engine.has_moe_layers``).

    DeepSpeed decides it with ``isinstance(module, deepspeed.moe.layer.MoE)`` while it builds the
    optimizer (expert parameter groups, ``_configure_moe_settings``); the class it checks is swapped
    for ours for the duration (it reads only ``module.num_experts``).
    """
    # lazy: DeepSpeed takes seconds to import; only where an engine is built
    import deepspeed.runtime.engine as ds_engine

    from restage.models.moe import MoEMLP

    original = ds_engine.MoE
    ds_engine.MoE = MoEMLP
    try:
        yield
    finally:
        ds_engine.MoE = original


def checkpoint_per_ep_rank(engine: Engine, layout: Layout, rank: int) -> None:
    """Save and load the engine's module file per ep-rank (see the module docstring)."""
    coord = layout.coord(rank)
    assert coord is not None, f"rank {rank} is not in {layout}"
    ep_rank = layout.strategy.ep_rank(coord.dp)
    engine.has_moe_layers = False  # the plain checkpoint format, not DeepSpeed's MoE-module one
    engine.save_non_zero_checkpoint = coord.dp < layout.strategy.ep  # the first replica of each ep-rank
    plain = engine._get_ckpt_name

    def name_with_ep_rank(checkpoints_path: str, tag: str, mp_placeholder: str | None = None,
                          pp_placeholder: str | None = None) -> str:
        head, tail = os.path.split(plain(checkpoints_path, tag, mp_placeholder, pp_placeholder))
        return os.path.join(head, f"ep_rank_{ep_rank:02d}_{tail}")

    engine._get_ckpt_name = name_with_ep_rank
