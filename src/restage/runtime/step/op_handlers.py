"""What each op of the schedule does on one rank, over explicit parts: the model store, the process groups,
the data flow and the clock. The Worker dispatches (``Worker.run_step``); the handlers do.

A pass over the ops (an iteration, or one evaluation pass) threads one :class:`StepData` through them:
the MFC outputs this rank produced, the inputs transferred to it, and the data set split the pass reads
dataset keys from.

Function rewards do not hold the rank up. A generate MFC's rewards are started on the run's reward pool
(``CallContext.scoring``, ``algorithms/scoring.py``) and its output is kept without them
(``StepData.scoring``); the rank goes on with its next ops (a reference or critic inference, transfers of
the answers), and the rewards are waited for and attached only where the schedule first sends that key
(``Worker.run_step`` settles them before that transfer), or at the end of the pass. The schedule and the
algorithm contract are unchanged: a consumer still receives the key by a transfer; only the producer's
wait moved from the end of its MFC to that transfer. A reward that raises stops the run there, in the same
step and with the same message.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, assert_never

import torch
import torch.distributed as dist

from restage.algorithms.base import AlgoState, CallContext, PendingRewards
from restage.algorithms.estimators import ema_master, ema_mix_
from restage.algorithms.interface import Algorithm
from restage.algorithms.scoring import limited
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.data.datasets import Dataset
from restage.device import DTYPES
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout, ProcessGroups
from restage.models.decoder import StageModule
from restage.models.parallel import ParallelContext
from restage.runtime.control.channels import wait_for_ranks
from restage.runtime.control.clock import Clock, peak_memory_bytes
from restage.runtime.control.records import MFCRecord, StatsShare, StepRecord
from restage.runtime.dataplane.realloc import ReallocResult, execute_reallocation
from restage.runtime.dataplane.routing import SampleRouter, measured_flops
from restage.runtime.step import dynamic_sampling
from restage.runtime.step.execute import MFCResult, run_inference, run_train, step_seed
from restage.runtime.step.multi_turn import generate_batch
from restage.runtime.step.nonfinite import NonFiniteError, any_rank, nonfinite_samples, nonfinite_stats
from restage.runtime.store.model_store import ModelSlot, ModelStore
from restage.runtime.store.zero3_generation import generation_module
from restage.runtime.store.zero_engines import engine_groups
from restage.schedule.execution import Async, Sync
from restage.schedule.ops import Ema, Realloc, Run, SendKey
from restage.schedule.realloc_plan import ReallocPlan

# Sums a tensor over a DP group (``dp_reducer``); what ``prepare_train`` is handed as ``reduce``.
Reducer = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StepData:
    """What one pass over the ops reads and produces on this rank (made afresh for each pass)."""

    source: Dataset  # the split dataset keys are read from
    outputs: dict[str, Batch] = field(default_factory=dict)  # MFC name -> this rank's output
    inputs: dict[str, list[Batch]] = field(default_factory=dict)  # MFC name -> parts transferred to this rank
    scoring: dict[str, PendingRewards] = field(default_factory=dict)  # generate MFC -> its rewards, still scored
    # rewards under a time limit (rewards.timeout_seconds): the share of each settled batch's answers that ran past it
    reward_stats: list[StatsShare] = field(default_factory=list)

    def keep(self, mfc_name: str, batch: Batch, pending: PendingRewards | None) -> None:
        """Keep an MFC's output; function rewards its ``after_generate`` started (``pending``) stay so until
        ``settle``."""
        self.outputs[mfc_name] = batch
        if pending is not None:
            self.scoring[mfc_name] = pending

    def waits_for(self, producer: str, key: str) -> bool:
        """Whether ``key`` of ``producer``'s output is a reward still being scored."""
        return producer in self.scoring and self.scoring[producer].key == key

    def settle(self, producer: str | None = None) -> None:
        """Wait for the rewards of ``producer`` (or of every generate MFC) and attach them to its output."""
        for name in [producer] if producer is not None else list(self.scoring):
            pending = self.scoring.pop(name)
            batch = self.outputs[name] = pending.attach(self.outputs[name])
            if limited(pending.scores.options):
                share = pending.scores.timed_out() / max(1, batch.n_seqs)
                self.reward_stats.append(StatsShare({f"{name}/reward_timed_out": share}, batch.n_samples))


class OpHandlers:
    """The body of every op kind on this rank; ``skipped`` counts each train MFC's consecutive non-finite skips."""

    def __init__(self, store: ModelStore, groups: ProcessGroups, router: SampleRouter, clock: Clock,
                 layouts: dict[str, Layout], cfg: ExperimentConfig, algo: Algorithm, state: AlgoState,
                 context: CallContext) -> None:
        self.store, self.groups, self.router, self.clock = store, groups, router, clock
        self.graph: DataflowGraph = store.graph
        self.layouts, self.cfg, self.algo, self.state = layouts, cfg, algo, state
        self.context = context  # the run's: the samples' dataset fields and the reward pool (a train step adds its version)
        self.rank, self.device = store.rank, store.device
        self.skipped: dict[str, int] = {}  # train MFC -> consecutive steps skipped for non-finite inputs

    # -- run -----------------------------------------------------------------------------------------
    def run(self, op: Run, step: int, data: StepData, record: StepRecord) -> None:
        mfc = self.graph[op.mfc]
        slot = self.store.slots[mfc.model]
        layout = self.layouts[mfc.name]
        ctx = ParallelContext.from_layout(layout, self.groups, self.rank)
        batch = self.input_batch(mfc, layout, ctx.coord.dp, data)
        seed = step_seed(self.cfg.seed, step) + ctx.coord.dp  # training's minibatch order; generation keys by sample
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        begin = self.clock.now_synced()
        match mfc.kind:
            case MFCKind.GENERATE if mfc.options.dynamic_sampling_rounds is not None:
                with generation_module(slot.at(layout), layout, self.groups) as module:
                    result = self.generate_filled(module, mfc, layout, batch, step, data)
            case MFCKind.GENERATE:
                # A model ZeRO-3 partitions (generating on its training layout): gathered once, or its replicas in
                # lockstep.
                with generation_module(slot.at(layout), layout, self.groups) as module:
                    result = generate_batch(module, mfc, batch, self.algo, self.cfg, self.state, self.context,
                                            step_seed(self.cfg.seed, step))
            case MFCKind.INFERENCE:
                agree = slot.sharded.group if slot.sharded is not None else None  # its dp ranks gather in step
                result = run_inference(slot.at(layout), mfc, batch, self.algo, self.cfg, self.state, agree)
            case MFCKind.TRAIN_STEP:
                result = self.train(mfc, slot, layout, ctx, batch, step, seed)
            case _:
                assert_never(mfc.kind)
        end = self.clock.now_synced()
        if result.batch is not None:
            data.keep(mfc.name, result.batch, self.taken_rewards(mfc.name))
        self.record_run(mfc, layout, ctx, batch, result, begin, end, record)

    def train(self, mfc: MFC, slot: ModelSlot, layout: Layout, ctx: ParallelContext, batch: Batch, step: int,
              seed: int) -> MFCResult:
        """A train step; skipped (one stat) where its inputs are not finite."""
        call = self.context
        match self.store.schedule.execution:
            case Async():  # the version this step trains from: one per completed step
                call = dataclasses.replace(call, policy_version=step)
            case Sync():
                pass
            case _:
                assert_never(self.store.schedule.execution)
        # Checked before prepare_train too: it folds rewards into algorithm state (normalisers, KL control).
        skip = self.nonfinite_inputs(mfc, layout, batch, step)
        if not skip:
            batch, prep_stats = self.algo.prepare_train(batch, self.cfg, self.state, step, self._dp_reduce(ctx))
            skip = self.nonfinite_inputs(mfc, layout, batch, step)
        if skip:
            return MFCResult(None, {f"{mfc.name}/skipped_nonfinite": 1.0}, 0)
        assert slot.engine is not None, f"{mfc.name}: {mfc.model} has no engine on this rank"
        with engine_groups(slot.engine):
            result = run_train(slot.engine, mfc, batch, self.algo, self.cfg, self.state, call, seed,
                               slot.entry.router_aux_loss_coef)
        result.stats.update({f"{mfc.name}/{k}": v for k, v in prep_stats.items()})
        if bad := nonfinite_stats(result.stats):
            raise NonFiniteError(f"step {step + 1}: {mfc.name} trained on finite inputs but its "
                                 f"{', '.join(bad)} is not finite; its weights are not saved (the newest "
                                 "checkpoint is the last finite one)")
        return result

    def generate_filled(self, module: StageModule, mfc: MFC, layout: Layout, batch: Batch, step: int,
                        data: StepData, version: int | None = None) -> MFCResult:
        """A generate MFC under DAPO's dynamic sampling: groups whose rewards are all equal are replaced by fresh
        prompts' groups, the layout's ranks agreeing on each extra round (runtime/step/dynamic_sampling.py). ``step``:
        the step the batch is for; ``version``: async mode's policy version of ``module``."""
        group = self.groups.get(layout.mesh) if layout.size > 1 else None
        return dynamic_sampling.fill_batch(
            dynamic_sampling.generator(module, mfc, self.algo, self.cfg, self.state, self.context, version), mfc, batch,
            data.source.batch,
            len(data.source), self.context.scoring, step_seed(self.cfg.seed, step), step, self.cfg.seed,
            lambda flag: any_rank(flag, group, self.device))

    def taken_rewards(self, mfc_name: str) -> PendingRewards | None:
        """The function rewards ``mfc_name``'s ``after_generate`` just started (None: none, or scored already)."""
        return self.context.scoring.take(mfc_name) if self.context.scoring is not None else None

    def record_run(self, mfc: MFC, layout: Layout, ctx: ParallelContext, batch: Batch, result: MFCResult, begin: float,
                   end: float, record: StepRecord) -> None:
        """An MFC run's row (time, tokens, FLOPs, peak memory) and, from one rank per DP replica, its statistics."""
        slot = self.store.slots[mfc.model]
        peak = peak_memory_bytes(self.device)
        flops = measured_flops(mfc, slot.cfg, result.batch if result.batch is not None else batch, result.tokens)
        flops /= layout.strategy.tp * layout.strategy.pp  # this rank's share of its replica's work
        tokens = result.tokens // (layout.strategy.tp * layout.strategy.pp)
        record.mfcs.append(MFCRecord(mfc.name, mfc.model, mfc.kind, begin, end, tokens, flops, peak))
        if ctx.coord.tp == 0 and ctx.coord.pp == ctx.strategy.pp - 1:  # one reporter per DP replica
            record.stats.append(StatsShare(result.stats, batch.n_samples))

    def nonfinite_inputs(self, mfc: MFC, layout: Layout, batch: Batch, step: int) -> bool:
        """Whether this train MFC skips the step: NaN or inf in its inputs on any of its ranks (runtime/step/nonfinite.py)."""
        samples, keys = nonfinite_samples(batch)
        group = self.groups.get(layout.mesh) if layout.size > 1 else None
        if not any_rank(bool(samples), group, self.device):
            self.skipped[mfc.name] = 0
            return False
        where = f"step {step + 1}: {mfc.name}"
        if samples:
            print(f"restage: {where}: non-finite {', '.join(keys)} in samples {samples} on rank {self.rank}", flush=True)
        self.skipped[mfc.name] = self.skipped.get(mfc.name, 0) + 1
        run = self.cfg.run
        if run.nonfinite == "stop":
            raise NonFiniteError(f"{where}: non-finite inputs (NaN or inf rewards, advantages or log-probs); "
                                 "fix the reward or data, or set run.nonfinite=skip to skip such steps")
        if self.skipped[mfc.name] >= run.max_skipped_steps:
            raise NonFiniteError(f"{where}: non-finite inputs in {self.skipped[mfc.name]} steps in a row "
                                 f"(run.max_skipped_steps={run.max_skipped_steps}); fix the reward or data")
        return True

    def _dp_reduce(self, ctx: ParallelContext) -> Reducer | None:
        if ctx.strategy.dp == 1:
            return None
        return dp_reducer(self.groups.get(ctx.dp_ranks), self.device)

    def input_batch(self, mfc: MFC, layout: Layout, dp_rank: int, data: StepData) -> Batch:
        """This DP rank's slice of the MFC's inputs: dataset keys read locally, the rest as transferred."""
        parts: list[Batch] = []
        source = [k for k in mfc.inputs if self.graph.producer(k) is None]
        if source:
            positions = self.router.dataset_positions(mfc, dp_rank)
            parts.append(data.source.batch(positions).only(source))
        parts += data.inputs.get(mfc.name, [])
        return _merge(parts)

    # -- data and parameter movement -------------------------------------------------------------------
    def realloc(self, op: Realloc) -> int:
        """A copy of ``op.model`` in ``op.dst`` from its home (only the adapters into a LoRA copy that holds the
        base); returns the bytes this rank sent."""
        store = self.store
        if store.copy_current(op.model, op.dst):
            return 0
        slot = store.slots[op.model]
        source = slot.engine if slot.engine is not None else slot.module
        # The copy is read-only and dropped before its source next changes (a trained model's after
        # its last use, a reference's once its EMA moves), so tensors this rank holds whole are shared.
        # (A LoRA model's copy is kept, but its base never changes and its adapters are moved again before
        # each use.) The executor allocates the rest.
        plan = store.realloc_plan(op.model, op.src, op.dst, adapters_only=store.holds_base(op.model, op.dst))
        result = reallocate_when_ready(plan,
                                       source if self.rank in op.src else None, self.groups,
                                       self.cfg.run.peer_wait_timeout_seconds, dtype=DTYPES[slot.entry.dtype],
                                       share_local=True, device=self.device)
        store.adopt_copy(op.model, op.dst, result.state, self.groups)
        return result.stats.sent_bytes

    def ema(self, op: Ema) -> int:
        """``op.model <- (1 - eta) op.model + eta trained``: reallocate the trained model into the reference's home, mix."""
        mfc = self.graph[op.mfc]
        trained, target = self.store.slots[mfc.model], self.store.slots[op.model]
        plan = self.store.realloc_plan(mfc.model, op.src, op.dst)
        source = trained.engine if self.rank in op.src else None
        result = reallocate_when_ready(plan, source, self.groups, self.cfg.run.peer_wait_timeout_seconds,
                                       dtype=DTYPES[trained.entry.dtype], share_local=True)
        if self.rank in op.dst:
            assert mfc.options.ref_ema is not None, f"{mfc.name} has no reference EMA"
            eta = mfc.options.ref_ema.eta
            assert target.module is not None, f"rank {self.rank} of {op.model}'s home {op.dst} holds no shard"
            params = dict(target.module.named_parameters())
            for name, mixed_in in result.state.items():
                if name not in target.ema_master and (master := ema_master(params[name])) is not None:
                    target.ema_master[name] = master  # a bf16/fp16 reference mixes in fp32 (ema_mix_)
                ema_mix_(params[name].data, mixed_in.to(params[name].device), eta,  # where it lives now (maybe host)
                         target.ema_master.get(name))
            if target.host_copy is not None:
                target.host_copy.changed()
        return result.stats.sent_bytes

    def transfer(self, op: SendKey, data: StepData) -> int:
        mine = data.outputs.get(op.producer)
        received, nbytes = self.router.execute(op, mine)
        if received is not None:
            data.inputs.setdefault(op.mfc, []).append(received)
        return nbytes


def dp_reducer(group: dist.ProcessGroup | None, device: torch.device) -> Reducer:
    """Sum over the DP group: tensors computed on the host go to the rank's device for the collective and come back."""

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(device, copy=True)  # NCCL has no host backend; copy: the caller's tensor stays as it was
        dist.all_reduce(out, group=group)
        return out.to(tensor.device)

    return reduce


def reallocate_when_ready(plan: ReallocPlan, source: object, groups: ProcessGroups, peer_wait_timeout_seconds: float,
                          **options: Any) -> ReallocResult:
    """``execute_reallocation`` once every rank of the plan has arrived, so the data-plane timeout times only the move."""
    wait_for_ranks(sorted({*plan.src.mesh, *plan.dst.mesh}), peer_wait_timeout_seconds)
    return execute_reallocation(plan, source, groups, **options)


def _merge(parts: list[Batch]) -> Batch:
    """Union of the keys of several batches over the same samples (same order)."""
    if not parts:
        raise ValueError("MFC has no inputs")
    # Per-sequence keys of another generation (ReMax's greedy baseline rewards) arrive with that
    # generation's lengths: only their samples must agree, and the token-carrying part sets the lengths.
    out = next((part for part in parts if part.tokens), parts[0])
    for part in parts:
        if part is out:
            continue
        same = part.seqlens == out.seqlens if part.tokens else (part.n_seqs == out.n_seqs and part.ids == out.ids)
        if not same:
            raise RuntimeError(f"inputs disagree on the samples: {part.ids} vs {out.ids}")
        out = out.with_keys(tokens=part.tokens, seqs=part.seqs)
    return out
