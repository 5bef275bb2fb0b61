"""What async mode's ops do on one rank (``schedule/async_program.py``): weight pushes, generation ahead into the
rollout buffer, and taking a step's batch out of it (docs/runtime.md, "Asynchronous training").

Policy versions: the actor's weights at the start of step ``s`` (``s`` completed steps) are version ``s``. A push
at step ``s`` gives the generation copy version ``s``; every token it generates records that version
(``versions``); the train MFCs of step ``s`` train from version ``s`` (``OpHandlers.run`` hands the
loss ``CallContext.policy_version``), so a token's version gap is ``s`` minus the version that wrote it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from restage.data.batch import Batch
from restage.device import DTYPES
from restage.layout import Layout
from restage.models.parallel import ParallelContext
from restage.runtime.control.records import StatsShare, StepRecord
from restage.runtime.dataplane.rollout_buffer import Begun, Buffered, RolloutBuffer
from restage.runtime.step.execute import step_seed
from restage.runtime.step.multi_turn import generate_batch
from restage.runtime.step.op_handlers import OpHandlers, StepData, reallocate_when_ready
from restage.runtime.step.partial_episodes import EpisodesInFlight, run_partial_episodes
from restage.runtime.step.partial_rollouts import run_partial_generate
from restage.schedule.ops import Generate, Push, TakeBuffered


class AsyncOps:
    """The async ops over the rank's handlers, its rollout buffer and the versions its generation copies hold."""

    def __init__(self, handlers: OpHandlers, first_step: int) -> None:
        self.handlers = handlers
        self.first_step = first_step  # a rank's first step pushes whatever the step: its copies start empty
        self.buffer = RolloutBuffer()
        self.versions: dict[tuple[str, Layout], int] = {}  # (model, generation layout) -> version its copy holds

    def push_due(self, op: Push, step: int) -> bool:
        """Whether step ``step`` pushes: every rank of the push decides alike, from the step alone."""
        return step % op.every == 0 or step == self.first_step

    def push(self, op: Push, step: int) -> int:
        """The trained model's home weights into its generation copy (kept until the next push); bytes sent."""
        h = self.handlers
        store, slot = h.store, h.store.slots[op.model]
        plan = store.realloc_plan(op.model, op.src, op.dst, adapters_only=store.holds_base(op.model, op.dst))
        source = (slot.engine if slot.engine is not None else slot.module) if h.rank in op.src else None
        # No sharing with the home shards: the copy must keep this version while the home trains on.
        result = reallocate_when_ready(plan, source, h.groups, h.cfg.run.peer_wait_timeout_seconds,
                                       dtype=DTYPES[slot.entry.dtype], share_local=False, device=h.device)
        store.adopt_copy(op.model, op.dst, result.state, h.groups)
        self.versions[(op.model, op.dst)] = step
        return result.stats.sent_bytes

    def generate(self, op: Generate, step: int, data: StepData, ids_by_step: dict[int, list[int]],
                 record: StepRecord) -> None:
        """Answer the prompts of each step in ``step + op.start .. step + op.stop - 1`` the buffer lacks; buffer them."""
        h = self.handlers
        mfc, layout = h.graph[op.mfc], op.layout
        slot = h.store.slots[mfc.model]
        ctx = ParallelContext.from_layout(layout, h.groups, h.rank)
        version = self.versions[(mfc.model, layout)]
        source_keys = [k for k in mfc.inputs if h.graph.producer(k) is None]

        def prompts_of(target: int) -> Batch:
            positions = h.router.positions_of(ids_by_step[target], data.source, mfc, ctx.coord.dp)
            return data.source.batch(positions).only(source_keys)

        def seed_of(target: int) -> int:
            return step_seed(h.cfg.seed, target)  # the step it is for, as in sync mode

        for target in range(step + op.start, step + op.stop):
            if target >= h.cfg.run.steps or self.buffer.holds(mfc.name, target):
                continue
            prompts = prompts_of(target)
            seed = seed_of(target)
            if op.partial:
                self._generate_partial(op, target, prompts, prompts_of, seeds=(seed, seed_of(target + 1)),
                                       version=version, ctx=ctx, record=record)
                continue
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            begin = h.clock.now_synced()
            if mfc.options.dynamic_sampling_rounds is not None:  # DAPO: the batch of step target, its all-equal groups refilled
                result = h.generate_filled(slot.at(layout), mfc, layout, prompts, target, data, version)
            else:
                result = generate_batch(slot.at(layout), mfc, prompts, h.algo, h.cfg, h.state, h.context, seed, version)
            end = h.clock.now_synced()
            assert result.batch is not None
            self.buffer.put(mfc.name, target, Buffered(result.batch, version, h.taken_rewards(mfc.name)))
            h.record_run(mfc, layout, ctx, prompts, result, begin, end, record)

    def _generate_partial(self, op: Generate, target: int, prompts: Batch, prompts_of: Callable[[int], Batch],
                          seeds: tuple[int, int], version: int, ctx: ParallelContext, record: StepRecord) -> None:
        """Partial rollouts: finish step ``target``'s batch (continuing the answers begun at the step before) and
        begin step ``target + 1``'s, whose answers so far stay in the buffer (runtime/step/partial_rollouts.py)."""
        h = self.handlers
        mfc = h.graph[op.mfc]
        later = prompts_of(target + 1) if target + 1 < h.cfg.run.steps else None
        begun = self.buffer.resume_in_flight(mfc.name, target)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        begin = h.clock.now_synced()
        module = h.store.slots[mfc.model].at(op.layout)
        started: Begun | None
        if h.cfg.environment.name:  # multi-turn episodes (runtime/step/partial_episodes.py)
            assert begun is None or isinstance(begun, EpisodesInFlight)
            result, oldest, started = run_partial_episodes(module, mfc, prompts, begun, later, h.algo, h.cfg,
                                                           h.state, h.context, seeds, version)
        else:
            assert begun is None or isinstance(begun, tuple)
            result, oldest, started = run_partial_generate(module, mfc, prompts, begun, later, h.algo, h.cfg,
                                                           h.state, h.context, seeds, version)
        end = h.clock.now_synced()
        assert result.batch is not None
        self.buffer.put(mfc.name, target, Buffered(result.batch, oldest, h.taken_rewards(mfc.name)))
        if started is not None:
            self.buffer.keep_in_flight(mfc.name, target + 1, started)
        h.record_run(mfc, op.layout, ctx, prompts, result, begin, end, record)

    def take(self, op: TakeBuffered, step: int, data: StepData, record: StepRecord) -> None:
        """The buffer's batch of this step becomes the MFC's output; logs the buffer's occupancy and the batch's version."""
        entry = self.buffer.take(op.mfc, step)
        data.outputs[op.mfc] = entry.batch
        if entry.pending is not None:
            data.scoring[op.mfc] = entry.pending
        coord = op.layout.coord(self.handlers.rank)
        if coord is not None and coord.tp == 0 and coord.pp == op.layout.strategy.pp - 1:
            record.taken_tokens[op.mfc] = int(entry.batch.n_tokens)  # the step's tokens (master.step_tokens)
            stats = {f"{op.mfc}/buffer_batches": float(self.buffer.occupancy(op.mfc)),
                     f"{op.mfc}/behaviour_version": float(entry.version)}
            if "versions" in entry.batch.tokens:
                stats[f"{op.mfc}/mixed_version_samples"] = mixed_version_samples(entry.batch)
            record.stats.append(StatsShare(stats, _samples(entry.batch)))


def mixed_version_samples(batch: Batch) -> float:
    """The fraction of ``batch``'s samples whose answer tokens more than one policy version wrote."""
    spans = [len({v for v in seq.tolist() if v >= 0}) > 1 for seq in torch.split(batch["versions"], list(batch.seqlens))]
    return sum(spans) / max(1, len(spans))


def _samples(batch: Batch) -> int:
    return max(1, batch.n_samples)
