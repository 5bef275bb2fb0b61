"""One DeepSpeed ZeRO engine per trainable model, over the model's training layout.

ZeRO partitions over the layout's DP group; the TP x PP ranks that share a DP index form the
"model parallel" group DeepSpeed uses for the global gradient norm and overflow checks. Our own
pipeline schedule (not DeepSpeed's PipelineEngine) runs the stages, so DeepSpeed sees each stage
as a model-parallel shard.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from restage.layout import Layout, ProcessGroups
from restage.runtime.control.channels import local_rank
from restage.runtime.store.expert_engine import checkpoint_per_ep_rank, mark_expert_params, moe_layers_seen, register_groups
from restage.schedule.model_entry import effective_zero_stage as _zero_stage_of

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

Engine: TypeAlias = Any  # a DeepSpeedEngine: DeepSpeed ships no type information

_DTYPE_CONFIG: dict[str, dict[str, Any]] = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
                 "fp16": {"fp16": {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100}}}


class LayoutMPU:
    """DeepSpeed's ``mpu`` interface over one layout: data-parallel and model-parallel (tp x pp) groups."""

    def __init__(self, layout: Layout, rank: int, groups: ProcessGroups):
        coord = layout.coord(rank)
        if coord is None:
            raise ValueError(f"rank {rank} is not in {layout}")
        s = layout.strategy
        self._dp_ranks = layout.group_of(rank, "dp")
        self._mp_ranks = layout.group_of(rank, "mp")
        self._tp_ranks = layout.group_of(rank, "tp")
        self._groups = groups
        self.coord = coord
        self.strategy = s

    def _group(self, ranks: tuple[int, ...]) -> ProcessGroup:
        group = self._groups.get(ranks)
        if group is None:
            raise ValueError(f"no process group over {ranks}; build ProcessGroups(..., singletons=True)")
        return group

    def get_data_parallel_group(self) -> ProcessGroup:
        return self._group(self._dp_ranks)

    def get_data_parallel_rank(self) -> int:
        return self.coord.dp

    def get_data_parallel_world_size(self) -> int:
        return self.strategy.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_model_parallel_group(self) -> ProcessGroup:
        return self._group(self._mp_ranks)

    def get_model_parallel_rank(self) -> int:
        return self.coord.pp * self.strategy.tp + self.coord.tp

    def get_model_parallel_world_size(self) -> int:
        return self.strategy.tp * self.strategy.pp

    def get_tensor_model_parallel_group(self) -> ProcessGroup:
        return self._group(self._tp_ranks)

    def get_tensor_model_parallel_rank(self) -> int:
        return self.coord.tp

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.strategy.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._tp_ranks[0]


def stage_local_trace_checks() -> None:
    """Turn off ZeRO-3's world-wide check that every rank traced the same modules.

    While it records a module's first forwards, DeepSpeed's parameter coordinator checks at the end of each one
    (``reset_step``) that every rank traced the same submodules and parameters, with broadcasts over the *whole
    world* (``zero.utils.assert_ints_same_as_other_ranks``). Under pipeline parallelism each stage traces its own
    module at its own moment, so one stage's broadcast met another stage's pipeline traffic and the job hung (a
    dp2 x pp2 ZeRO-3 critic inferring at step 1, found by tests/scale). The dp ranks of a stage, the only ones that
    gather each other's parameters, run the same module order by construction (they agree on their micro-batch
    counts, runtime/step/execute.py), which is all the check guards. No group-aware form exists to call instead:
    DeepSpeed hands the check only the ints.
    """
    # lazy: DeepSpeed takes seconds to import; only a ZeRO-3 engine comes here
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    coordinator.assert_ints_same_as_other_ranks = _agreed  # DeepSpeed imported it into that module by name


def _agreed(ints: list[int]) -> None:
    """The stage's dp ranks traced the same modules by construction (``stage_local_trace_checks``)."""


@contextlib.contextmanager
def barriers_on(engine_group: ProcessGroup | None) -> Iterator[None]:
    """Point DeepSpeed's world-wide barriers at one engine's group for the duration.

    DeepSpeed barriers on the whole world in ZeRO-3 set-up and in checkpoint save/load, but here
    only the ranks of the model's own layout take part in those calls.
    """
    # lazy: DeepSpeed takes seconds to import; only where an engine is built
    import deepspeed.comm as ds_comm

    original = ds_comm.barrier

    def barrier(group: ProcessGroup | None = None, **kwargs: Any) -> Any:
        return original(group=engine_group if group is None else group, **kwargs)

    ds_comm.barrier = barrier
    try:
        yield
    finally:
        ds_comm.barrier = original


@contextlib.contextmanager
def engine_groups(engine: Engine) -> Iterator[None]:
    """Point DeepSpeed's module-level ``groups.mpu`` at ``engine``'s own layout for the duration.

    DeepSpeed keeps one global mpu, set by the engine built last, and reads it live in the ZeRO-0
    gradient all-reduce (``_get_sequence_data_parallel_group``) and in checkpointing. With several
    engines (actor and critic) on other layouts that reduced one model's gradients over another
    model's DP group: wrong sums, or a hang when the groups span different ranks.
    """
    # lazy: DeepSpeed takes seconds to import; only where an engine is built
    from deepspeed.utils import groups

    saved = groups.mpu
    groups.mpu = engine.mpu
    try:
        yield
    finally:
        groups.mpu = saved


def mark_norm_ownership(module: torch.nn.Module, tp_rank: int, replicated_names: AbstractSet[str],
                        duplicate_names: AbstractSet[str] = frozenset()) -> None:
    """Make DeepSpeed count each parameter exactly once in the global gradient norm.

    DeepSpeed counts a parameter if it is marked ``model_parallel`` or if this rank is model-parallel
    rank 0. We mark every parameter this rank owns for the norm: sharded ones everywhere, TP-replicated
    ones on tp rank 0 only; ``duplicate_names`` (the tied embedding copy on the last stage) nowhere.
    """
    for name, param in module.named_parameters():
        owned = name not in duplicate_names and (name not in replicated_names or tp_rank == 0)
        param.model_parallel = owned  # type: ignore[attr-defined]  # DeepSpeed's own mark on a Parameter


class OptimizerSettings(Protocol):
    """AdamW and its LR schedule, as ``config.optim.OptimConfig`` holds them."""

    @property
    def lr(self) -> float: ...
    @property
    def weight_decay(self) -> float: ...
    @property
    def betas(self) -> tuple[float, float]: ...
    @property
    def eps(self) -> float: ...
    @property
    def grad_clip(self) -> float: ...
    @property
    def lr_schedule(self) -> str: ...
    @property
    def warmup_steps(self) -> int: ...
    @property
    def min_lr_ratio(self) -> float: ...


class EngineSettings(Protocol):
    """What an engine is built from: the schedule's ``ModelEntry`` in a run (a test may hand a config's model)."""

    @property
    def dtype(self) -> str: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def offload_optimizer(self) -> bool: ...
    @property
    def offload_params(self) -> bool: ...
    @property
    def optim(self) -> OptimizerSettings: ...


def lr_lambda(spec: EngineSettings, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base LR at optimizer step ``i``: linear warmup, then constant / linear / cosine."""
    optim = spec.optim
    warmup = optim.warmup_steps
    floor = optim.min_lr_ratio

    def multiplier(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if optim.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if optim.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


def effective_zero_stage(spec: EngineSettings, dp: int, ep: int = 1) -> int:
    """The ZeRO stage the engine really uses (``schedule.model_entry.effective_zero_stage``, the one rule)."""
    return _zero_stage_of(spec.zero_stage, spec.offload_optimizer, dp, ep)


def deepspeed_config(spec: EngineSettings, dp: int, micro_batches: int, ep: int = 1) -> dict[str, Any]:
    """The DeepSpeed config dict for one trainable model."""
    optim = spec.optim
    zero: dict[str, Any] = {"stage": effective_zero_stage(spec, dp, ep)}
    if spec.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if spec.offload_params and spec.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        "train_batch_size": micro_batches * dp,
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {
            "lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps, "weight_decay": optim.weight_decay,
            # torch's AdamW everywhere but offload (which steps on the host with DeepSpeed's CPU Adam,
            # store/deepspeed_ops.py): on GPUs its multi-tensor kernels need no JIT build of DeepSpeed's FusedAdam,
            # so no nvcc on compute nodes and no rank waiting on a shared build lock.
            **({} if spec.offload_optimizer else {"torch_adam": True}),
        }},
        "steps_per_print": 10**9,
        # Tag validation all-reduces over the whole world; only this model's ranks save it.
        "checkpoint": {"tag_validation": "IGNORE"},
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer is on by default and, from its third step on, synchronizes the
        # device at the start of every forward of the engine's module (ThroughputTimer.start): a host
        # sync per micro-batch, and an illegal call inside a CUDA-graph capture when the actor generates
        # in its training layout (seen on an H200: cudaErrorStreamCaptureUnsupported at step 2 of
        # jobs/grpo_tiny.yaml). restage times its steps itself (runtime/control/clock.py).
        "timers": {"throughput": {"enabled": False}},
        **_DTYPE_CONFIG[spec.dtype],
    }
    return config


def build_engine(module: torch.nn.Module, spec: EngineSettings, layout: Layout, rank: int, groups: ProcessGroups,
                 micro_batches: int, total_optimizer_steps: int) -> Engine:
    """Wrap ``module`` (this rank's shard) in a DeepSpeed engine with an LR schedule from the config."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    os.environ.setdefault("LOCAL_RANK", str(local_rank()))  # DeepSpeed asserts it is set
    # lazy: DeepSpeed takes seconds to import; after DS_ACCELERATOR is set
    import deepspeed

    mpu = LayoutMPU(layout, rank, groups)
    schedule = lr_lambda(spec, total_optimizer_steps)
    ep = layout.strategy.ep
    moe: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if ep > 1:  # expert parameters reduced, partitioned and checkpointed over expert-dp (expert_engine.py)
        mark_expert_params(module, register_groups(layout, rank, groups))
        moe = moe_layers_seen()
    with barriers_on(groups.get(layout.mesh) if layout.size > 1 else groups.get((rank,))), moe:
        engine, _, _, _ = deepspeed.initialize(
            model=module,
            model_parameters=[p for p in module.parameters() if p.requires_grad],
            config=deepspeed_config(spec, layout.strategy.dp, micro_batches, ep),
            mpu=mpu,
            lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
            dist_init_required=False,
        )
    if ep > 1:
        checkpoint_per_ep_rank(engine, layout, rank)
    if effective_zero_stage(spec, layout.strategy.dp, ep) == 3:
        stage_local_trace_checks()
    if effective_zero_stage(spec, layout.strategy.dp, ep) == 0 and layout.strategy.dp == 1:
        engine.enable_backward_allreduce = False  # one DP rank: the all-reduce would only flatten and copy back
    return engine
