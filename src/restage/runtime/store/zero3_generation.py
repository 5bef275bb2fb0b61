"""Generation on a model DeepSpeed ZeRO-3 partitions over its dp group (the actor generating on its training layout).

DeepSpeed's forward hooks gather a partitioned module's parameters over the dp group in every forward, and dp
replicas whose answers end at different steps run different numbers of forwards. Two ways to make that safe:

* ``gather_once``: the stage's parameters are gathered unit by unit (embeddings and head, then each layer) into a
  plain copy of the stage, the call generates on the copy (no hooks: no gathers per forward, and CUDA-graph decode
  steps where they serve) and the copy is dropped after it. It holds the whole stage's parameters for the call.
* ``lockstep``: the call generates on the partitioned module; the rollout engine keeps the dp replicas in lockstep
  (``rollout.lockstep.lockstep_group``: one agreement per check, a one-token join forward for a replica with
  nothing to run), so every forward's gathers have all their ranks. It holds one unit at a time, but pays a
  gather of the stage per forward, joins included, and decodes eagerly.

The rule (``rollout.budget.gathers_once``, which the planner applies to its own figures): gather once when the
stage's parameters not already held whole fit in ``GATHER_ONCE_FRACTION`` of the memory available on every rank
of the layout (a GPU: free plus PyTorch's reserved-but-unallocated, ``rollout.cuda_available_bytes``; the host:
``MemAvailable``), else lockstep. The ranks take the smallest figure among them (one all-reduce over the layout),
so they all choose the same mode.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist

from restage.layout import Layout, ProcessGroups
from restage.models.decoder import StageModule
from restage.rollout.budget import cuda_available_bytes, gathers_once
from restage.rollout.lockstep import is_partitioned

Mode = Literal["gather_once", "lockstep"]


def host_available_bytes() -> int:
    """The host's ``MemAvailable`` (Linux), else its free pages."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gathered_bytes(module: StageModule) -> int:
    """Bytes a gathered copy of the stage adds: its parameters that are not held whole now (persistent ones are)."""
    numels = [int(p.ds_numel) for p in module.parameters() if not _held_whole(p)]  # type: ignore[attr-defined]
    return sum(numels) * module.dtype.itemsize


def choose_mode(module: StageModule, layout: Layout, groups: ProcessGroups) -> Mode:
    """``gather_once`` or ``lockstep`` by the rule above, the same on every rank of ``layout`` (one all-reduce)."""
    device = next(module.parameters()).device
    available = cuda_available_bytes(device) if device.type == "cuda" else host_available_bytes()
    if layout.size > 1:
        least = torch.tensor([available], dtype=torch.int64, device=device)
        dist.all_reduce(least, op=dist.ReduceOp.MIN, group=groups.get(layout.mesh))
        available = int(least.item())
    return "gather_once" if gathers_once(gathered_bytes(module), available) else "lockstep"


@contextlib.contextmanager
def generation_module(module: StageModule, layout: Layout, groups: ProcessGroups, mode: Mode | None = None
                      ) -> Iterator[StageModule]:
    """The module to generate with on this rank of ``layout`` for the duration: ``module`` itself unless ZeRO-3
    partitions it; else by ``mode`` (None: ``choose_mode``) a gathered copy, dropped after the block, or ``module``
    (its rollout then steps in lockstep). Every rank of the layout enters it."""
    if not is_partitioned(module):
        yield module
        return
    if (mode or choose_mode(module, layout, groups)) == "lockstep":
        yield module
        return
    copy = gathered_copy(module)
    try:
        yield copy
    finally:
        del copy


def gathered_copy(module: StageModule) -> StageModule:
    """A plain copy of a ZeRO-3 partitioned stage: gathered over its dp group one unit at a time (collective, in
    the same order on every rank); parameters already held whole are shared, not copied."""
    # lazy: DeepSpeed takes seconds to import; only a ZeRO-3 engine's module comes here
    import deepspeed

    units: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in module.named_parameters():
        parts = name.split(".")
        units.setdefault(".".join(parts[:2]) if parts[0] == "layers" else "", []).append((name, param))
    state: dict[str, torch.Tensor] = {}
    for unit in units.values():
        partitioned = [p for _, p in unit if not _held_whole(p)]
        gathered = {id(p) for p in partitioned}
        with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
            for name, param in unit:  # a gathered one is released after the block: copied; one held whole: shared
                state[name] = param.data.detach().clone() if id(param) in gathered else param.data.detach()
    copy = StageModule(module.cfg, module.ctx, module.dtype, torch.device("meta"))
    copy.hf_config = module.hf_config
    copy.load_state_dict(state, strict=True, assign=True)
    copy.requires_grad_(False)
    return copy.eval()


def _held_whole(param: torch.Tensor) -> bool:
    """A ZeRO-3 parameter this rank holds whole now: persistent (small ones, never released) or gathered."""
    # lazy: DeepSpeed takes seconds to import; only a ZeRO-3 engine's module comes here
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return bool(param.ds_status == ZeroParamStatus.AVAILABLE)  # type: ignore[attr-defined]  # DeepSpeed sets it
