"""The model copies one rank holds: each model's home shard (and DeepSpeed engine) and its copies in other layouts.

A model is loaded once, in its *home* layout (each rank reads only its slices); a trainable one gets
a DeepSpeed engine over it. Copies in other layouts are made by reallocation (``runtime/dataplane/realloc.py``,
over plans made once per (model, source, destination) and kept), dropped by ``free``; a frozen
model's home shard can sit in host memory between its MFCs (``offload``/``reload``,
``runtime/store/offload.py``). A frozen model's copy never goes stale, so it is made once. A LoRA model's copy
keeps its frozen base: the first reallocation into a layout moves every parameter, later ones only the
adapters (``adapters_only`` plans), written into the copy in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from restage.config.schema import ExperimentConfig
from restage.device import DTYPES
from restage.graph import DataflowGraph, MFCKind
from restage.layout import Layout, ProcessGroups
from restage.models.arch import ModelConfig
from restage.models.decoder import StageModule
from restage.models.hf_checkpoint import load_stage
from restage.models.parallel import ParallelContext
from restage.models.sharding import shard_specs
from restage.runtime.control.heartbeat import Heartbeat
from restage.runtime.dataplane import comm_budget
from restage.runtime.store.offload import ModelCopy
from restage.runtime.store.sharded_frozen import ShardedFrozen, check_sharded, load_sharded
from restage.runtime.store.zero_engines import Engine, build_engine, mark_norm_ownership
from restage.schedule.file import Schedule
from restage.schedule.model_entry import ModelEntry
from restage.schedule.program import check_ema_architectures, ema_targets
from restage.schedule.realloc_plan import ReallocPlan, plan_reallocation


@dataclass
class ModelSlot:
    """One model as this rank sees it: its home shard (and engine) and any copies in other layouts."""

    name: str
    entry: ModelEntry  # the schedule's: everything the planner resolved for the model (its one source)
    cfg: ModelConfig
    module: StageModule | None = None
    engine: Engine | None = None
    copies: dict[Layout, StageModule] = field(default_factory=dict)
    host_copy: ModelCopy | None = None  # a frozen model's home shard, offloaded between its MFCs
    sharded: ShardedFrozen | None = None  # a frozen model held 1/dp per rank of its home layout (shard_frozen)
    # A reference an EMA moves, held in bf16/fp16: its home shard in fp32 (host memory), made at its first mix
    # (estimators.ema_master), checkpointed and resumed (runtime/checkpoint/run_state.py).
    ema_master: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def home(self) -> Layout:
        return self.entry.home_layout

    def at(self, layout: Layout) -> StageModule:
        if layout == self.home:
            assert self.module is not None, f"rank holds no {self.name} shard in {layout}"
            return self.module
        return self.copies[layout]


class ModelStore:
    """Every model's slot on this rank, the reallocation plans between its layouts, and which frozen copies exist."""

    def __init__(self, schedule: Schedule, cfg: ExperimentConfig, graph: DataflowGraph, rank: int, device: torch.device,
                 node_of: Callable[[int], int]) -> None:
        self.schedule, self.cfg, self.graph = schedule, cfg, graph
        self.rank, self.device = rank, device
        # Block placement, as the planner costed it: runtime plans equal the estimator's (same node_of).
        self.node_of = node_of
        self.ema = ema_targets(graph)  # model updated by a reference EMA -> its train MFC
        self.slots: dict[str, ModelSlot] = {}
        self.realloc_plans: dict[tuple[str, Layout, Layout, bool], ReallocPlan] = {}
        self.frozen_copies: set[tuple[str, Layout]] = set()  # (model, layout) copies of frozen models already made
        self.base_copies: set[tuple[str, Layout]] = set()  # (model, layout) copies of LoRA models holding the base

    def realloc_plan(self, model: str, src: Layout, dst: Layout, adapters_only: bool = False) -> ReallocPlan:
        """The plan moving ``model`` (or, ``adapters_only``, its adapters) from ``src`` to ``dst`` (made once, kept)."""
        key = (model, src, dst, adapters_only)
        if key not in self.realloc_plans:
            cfg = comm_budget.realloc_model_config(self.schedule, model)
            self.realloc_plans[key] = plan_reallocation(cfg, src, dst, node_of=self.node_of,
                                                        bytes_per_element=DTYPES[self.schedule.models[model].dtype].itemsize,
                                                        adapters_only=adapters_only)
        return self.realloc_plans[key]

    def model_cfg(self, name: str) -> ModelConfig:
        return self.schedule.models[name].arch

    # -- start-up ------------------------------------------------------------------------------------
    def load(self, groups: ProcessGroups, heartbeat: Heartbeat) -> None:
        """Each model's shard in its home layout, on the ranks of that layout (every rank gets every slot)."""
        check_ema_architectures(self.graph, {name: self.model_cfg(name) for name in self.schedule.models})
        for name, info in self.schedule.models.items():
            home = info.home_layout
            critic = info.critic
            slot = ModelSlot(name, info, info.held_arch)
            if info.shard_frozen:
                self._check_sharded(slot)
            if self.rank in home and info.shard_frozen and home.strategy.dp > 1:
                heartbeat.doing(f"start-up: loading {name} ({info.path}), 1/{home.strategy.dp} per rank")
                slot.module, slot.sharded = load_sharded(info.path, home, groups, self.rank, DTYPES[info.dtype],
                                                         self.device, critic)
                slot.cfg = slot.module.cfg
            elif self.rank in home:
                heartbeat.doing(f"start-up: loading {name} ({info.path})")
                slot.module = load_stage(info.path, home, groups, self.rank, DTYPES[info.dtype], self.device,
                                         critic=critic, lora=info.arch.lora)
                slot.cfg = slot.module.cfg
                if not info.trainable:
                    slot.module.requires_grad_(False)
                    slot.module.eval()
            self.slots[name] = slot
        heartbeat.reached("models loaded")

    def _check_sharded(self, slot: ModelSlot) -> None:
        """Refuse, in one line, a sharded frozen model (``runtime/store/sharded_frozen.py``) the schedule asks more of."""
        info, home = slot.entry, slot.home
        moved = any(e.mfc.model == slot.name and e.layout != home for e in self.schedule.mfcs)
        check_sharded(slot.name, info.trainable or slot.name in self.ema, info.offload_when_idle,
                      info.arch.lora is not None, home.strategy.ep, moved)

    def build_engines(self, groups: ProcessGroups, heartbeat: Heartbeat) -> None:
        """A DeepSpeed engine over each trainable model's home layout (collective over its ranks, in model order)."""
        for name, slot in self.slots.items():
            if slot.module is None or not slot.entry.trainable:
                continue
            heartbeat.doing(f"start-up: building {name}'s DeepSpeed engine (with its ranks)", waiting=True)
            train_mfc = next(m for m in self.graph if m.model == name and m.kind is MFCKind.TRAIN_STEP)
            optimizer_steps = self.cfg.run.steps * train_mfc.minibatches * train_mfc.epochs
            _mark_norm(slot.module)
            slot.module.checkpoint_blocks(slot.entry.gradient_checkpointing)
            slot.engine = build_engine(slot.module, slot.entry, slot.home, self.rank, groups,
                                       train_mfc.micro_batches, optimizer_steps)
            slot.module.eval()
        heartbeat.reached("engines built")

    # -- copies --------------------------------------------------------------------------------------
    def frozen(self, model: str) -> bool:
        """Whether ``model``'s weights never change (not trained, no EMA moves it)."""
        return not self.slots[model].entry.trainable and model not in self.ema

    def copy_current(self, model: str, layout: Layout) -> bool:
        """Whether a copy of ``model`` in ``layout`` was made and cannot have gone stale (a frozen model's).

        Decided from what every rank of the reallocation knows (not from holding the copy, which only
        destination ranks do): a sender must not send what no one receives."""
        return self.frozen(model) and (model, layout) in self.frozen_copies

    def holds_base(self, model: str, layout: Layout) -> bool:
        """Whether ``model`` is a LoRA model whose copy in ``layout`` holds its base (from what every rank of the
        reallocation knows, as ``copy_current``): then only its adapters need to move."""
        return (model, layout) in self.base_copies

    def adopt_copy(self, model: str, layout: Layout, state: Mapping[str, torch.Tensor], groups: ProcessGroups) -> None:
        """Keep the reallocated ``state`` as ``model``'s copy in ``layout`` (on its ranks); a frozen one is made once.

        The module adopts the tensors (built on "meta", it holds none); the copy is read-only. Into a LoRA
        model's copy that holds its base, ``state`` (its adapters) is written in place."""
        slot = self.slots[model]
        if self.frozen(model):
            self.frozen_copies.add((model, layout))
        if self.holds_base(model, layout):
            if self.rank in layout:
                copy = slot.copies[layout]
                for name, tensor in state.items():
                    copy.get_parameter(name).data = tensor
            return
        if slot.cfg.lora is not None:
            self.base_copies.add((model, layout))
        if self.rank in layout:
            ctx = ParallelContext.from_layout(layout, groups, self.rank)
            module = StageModule(slot.cfg, ctx, DTYPES[slot.entry.dtype], torch.device("meta"))
            module.load_state_dict(state, strict=True, assign=True)
            module.requires_grad_(False)
            module.eval()
            slot.copies[layout] = module

    def free(self, model: str, layout: Layout) -> None:
        self.slots[model].copies.pop(layout, None)
        self.frozen_copies.discard((model, layout))
        self.base_copies.discard((model, layout))

    def offload(self, model: str) -> None:
        """The home shard to host memory (copied the first time, or after an EMA changed it)."""
        if (copy := self._host_copy(model)) is not None:
            copy.offload()

    def reload(self, model: str) -> None:
        if (copy := self._host_copy(model)) is not None:
            copy.reload(self.device)

    def _host_copy(self, model: str) -> ModelCopy | None:
        slot = self.slots[model]
        if slot.module is None:
            return None
        if slot.host_copy is None:
            slot.host_copy = ModelCopy(slot.name, slot.module, trainable=False)
        return slot.host_copy


def _mark_norm(module: StageModule) -> None:
    ctx = module.ctx
    specs = shard_specs(module.cfg, ctx.shard_strategy, ctx.pp_stage, ctx.tp_rank, ctx.ep_rank)
    replicated = {s.param.name for s in specs if s.param.split_dim is None}
    duplicate = {"embed.weight"} if (module.tied_head and ctx.pp_size > 1 and not ctx.is_first_stage) else set()
    mark_norm_ownership(module, ctx.tp_rank, replicated, duplicate)
