"""One rank of a run: start-up, the iteration loop, and the dispatch of the ops it takes part in.

The parts it holds: the model store (``runtime/store/model_store.py``: every model's shard, engine and
copies), the op handlers (``runtime/step/op_handlers.py``: what each op does), the process groups, the
data flow and the clock; checkpoints are written from those parts (``runtime/checkpoint/run_state.py``).

Start-up (the same on every rank): read the schedule, join torch.distributed, create every
process group the schedule needs (collectively, in one order; ``comm_budget`` says which and
bounds them), load each model's shard in its
home layout (each rank reads only its slices), wrap trainable ones in DeepSpeed. Then, every
iteration: the master's sample ids arrive over MPI, the ops run, at the ``run.eval_every`` cadence
the held-out prompts are evaluated (``runtime/step/evaluation.py``; in async mode over a router and handlers of
their own, since the actor answers in its training layout there), records go back to the master, the
master's decision (checkpoint, stop) comes back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, assert_never

import torch
import torch.distributed as dist

from restage.algorithms.base import AlgoState, CallContext, RewardScoring
from restage.algorithms.interface import Algorithm, get_algorithm
from restage.algorithms.rewards import AccuracyFn, resolve_accuracy
from restage.algorithms.scoring import RewardPool
from restage.config.load import config_from_dict
from restage.config.schema import ExperimentConfig
from restage.data.datasets import Dataset, cut_prompts_warning, default_tokenizer_dir, load_splits, sample_fields
from restage.data.tokenizer import load_tokenizer
from restage.device import rank_device
from restage.errors import ConfigError, LayoutError
from restage.layout import Layout, ProcessGroups
from restage.runtime.checkpoint import checkpoint_dir
from restage.runtime.checkpoint import run_state as ckpt
from restage.runtime.control.channels import Control, init_torch_distributed
from restage.runtime.control.clock import Clock, measure_offset
from restage.runtime.control.heartbeat import Heartbeat, beat_interval_seconds
from restage.runtime.control.master import Master
from restage.runtime.control.records import MoveKind, MoveRecord, Span, StepRecord
from restage.runtime.dataplane import comm_budget
from restage.runtime.dataplane.routing import SampleRouter
from restage.runtime.step import evaluation
from restage.runtime.step.async_ops import AsyncOps
from restage.runtime.step.op_handlers import OpHandlers, StepData
from restage.runtime.store.deepspeed_ops import prepare_run_ops
from restage.runtime.store.feasibility import schedule_problem
from restage.runtime.store.model_store import ModelStore
from restage.schedule.async_program import steps_drawn_ahead
from restage.schedule.execution import Async, Sync
from restage.schedule.file import Schedule, read_schedule
from restage.schedule.ops import (
    WITH_PEERS,
    Ema,
    Free,
    Generate,
    Offload,
    Op,
    Push,
    Realloc,
    Reload,
    Run,
    SendKey,
    TakeBuffered,
)
from restage.testing import nccl_rules

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RunData:
    """What a rank reads before it joins any group: the algorithm, its tokenizer and state, the data sets, what every
    algorithm call is told, the held-out evaluation's plan and its accuracy function."""

    algo: Algorithm
    tokenizer: PreTrainedTokenizerBase
    state: AlgoState
    train_set: Dataset
    eval_set: Dataset
    context: CallContext
    eval_plan: evaluation.EvalPlan | None
    accuracy_fn: AccuracyFn | None

    @classmethod
    def read(cls, control: Control, cfg: ExperimentConfig, schedule: Schedule) -> RunData:
        algo = get_algorithm(cfg.algorithm)
        tokenizer = load_tokenizer(default_tokenizer_dir(cfg))
        state = algo.init_state(cfg, tokenizer)
        train_set, eval_set = load_splits(cfg, tokenizer)
        if control.is_master and (warning := cut_prompts_warning(cfg, train_set, eval_set)):
            print(f"restage: {warning}", flush=True)  # once per run, before the first step
        # What every algorithm call is told: the samples' dataset fields (the rewards' keywords) and the pool rewards
        # score on behind the next ops (op_handlers); a train step adds its policy version.
        context = CallContext(sample_fields=sample_fields(train_set, eval_set),
                              scoring=RewardScoring(RewardPool(cfg.rewards.workers)))
        graph = schedule.graph()
        offloaded = frozenset(op.model for op in schedule.ops() if isinstance(op, Offload))
        resident = frozenset(name for name, m in schedule.models.items() if m.arch.lora is not None)  # copies stay
        eval_plan = evaluation.plan_eval(graph, layouts_of(schedule), cfg, len(eval_set), offloaded,
                                         execution=schedule.execution, resident=resident)
        accuracy_fn = resolve_accuracy(cfg.reward_fn) if cfg.reward_fn else None
        return cls(algo, tokenizer, state, train_set, eval_set, context, eval_plan, accuracy_fn)


@dataclass(frozen=True)
class StepParts:
    """What a rank runs its ops with, made with every rank at start-up: the process groups, the samples' routers
    (the evaluation's over its own layouts where they differ) and the op handlers (async mode's too)."""

    groups: ProcessGroups
    router: SampleRouter
    eval_router: SampleRouter
    handlers: OpHandlers
    eval_handlers: OpHandlers
    async_ops: AsyncOps | None  # async mode only

    @classmethod
    def make(cls, control: Control, cfg: ExperimentConfig, schedule: Schedule, data: RunData, store: ModelStore,
             router: SampleRouter, eval_router: SampleRouter, clock: Clock) -> StepParts:
        """The run's process groups (``comm_budget.run_groups``: layouts and one per reallocation; singletons
        only where DeepSpeed needs them); data transfers use the MPI communicators made here, not groups."""
        ops, layouts = schedule.ops(), layouts_of(schedule)
        bound = comm_budget.communicator_bound(schedule, store.realloc_plan)
        if control.is_master:
            print(f"restage: {bound.summary()}", flush=True)
        nccl_rules.set_bound(max_groups=bound.max_communicators, max_pairs=bound.max_pairs)  # when the checks are on
        groups = ProcessGroups(comm_budget.run_groups(layouts.values(), ops),
                               singletons=comm_budget.singleton_ranks(schedule),
                               timeout_seconds=cfg.run.collective_timeout_seconds,
                               startup_timeout_seconds=cfg.run.startup_timeout_seconds)
        eval_ops = list(data.eval_plan.ops) if data.eval_plan is not None else []
        if eval_router is router:
            router.create_comms(ops + eval_ops, control.comm)
        else:  # every rank splits in the same order: the iteration's communicators, then the evaluation's
            router.create_comms(ops, control.comm)
            eval_router.create_comms(eval_ops, control.comm)
        handlers = OpHandlers(store, groups, router, clock, layouts, cfg, data.algo, data.state, data.context)
        eval_handlers = handlers
        if eval_router is not router:
            eval_handlers = OpHandlers(store, groups, eval_router, clock, eval_router.layouts, cfg, data.algo,
                                       data.state, data.context)
        match schedule.execution:
            case Sync():
                async_ops = None
            case Async():
                async_ops = AsyncOps(handlers, first_step=0)
            case _:
                assert_never(schedule.execution)
        return cls(groups, router, eval_router, handlers, eval_handlers, async_ops)


def layouts_of(schedule: Schedule) -> dict[str, Layout]:
    """Each MFC's layout, by name."""
    return {entry.mfc.name: entry.layout for entry in schedule.mfcs}


class Worker:
    """Everything one rank does in a run, built whole from its parts (``Worker.start`` makes them)."""

    def __init__(self, control: Control, cfg: ExperimentConfig, schedule: Schedule, trial_dir: Path,
                 heartbeat: Heartbeat, *, data: RunData, store: ModelStore, parts: StepParts, master: Master | None,
                 clock: Clock, start_step: int) -> None:
        self.control, self.cfg, self.schedule, self.trial_dir = control, cfg, schedule, trial_dir
        self.heartbeat = heartbeat  # what this rank is doing, for the launcher's watchdog
        self.rank = control.rank
        self.ops = schedule.ops()
        self.graph = schedule.graph()
        self.layouts = layouts_of(schedule)
        self.data, self.store, self.parts = data, store, parts
        self.algo, self.tokenizer, self.state = data.algo, data.tokenizer, data.state
        self.train_set, self.eval_set, self.context = data.train_set, data.eval_set, data.context
        self.eval_plan, self.accuracy_fn = data.eval_plan, data.accuracy_fn
        self.groups, self.router, self.eval_router = parts.groups, parts.router, parts.eval_router
        self.handlers = parts.handlers
        self.master, self.clock, self.start_step = master, clock, start_step
        # async mode: the steps past this one whose ids generation needs (schedule/async_program.py)
        match schedule.execution:
            case Sync():
                self.ahead: int | None = None
            case Async(staleness, push_every, partial):
                self.ahead = steps_drawn_ahead(staleness, push_every, partial)
            case _:
                assert_never(schedule.execution)

    # -- start-up ------------------------------------------------------------------------------------
    @classmethod
    def start(cls, control: Control, schedule_path: str | Path, trial_dir: Path, resume: str = "",
              heartbeat: Heartbeat | None = None) -> Worker:
        """``resume``: "" starts afresh, "required" continues from the last checkpoint, "if-any" does when one exists.

        Each phase is named to ``heartbeat`` (the watchdog bounds start-up by run.startup_timeout_seconds)."""
        beat = heartbeat or Heartbeat(trial_dir / "heartbeats", control.rank)  # not started: nobody reads it
        beat.doing("start-up: reading the schedule")
        schedule = read_schedule(schedule_path)
        if control.world_size != schedule.world_size:
            raise ConfigError(f"the schedule is for {schedule.world_size} ranks but {control.world_size} started; "
                              f"start {schedule.world_size} ranks (restage run -n {schedule.world_size}) or plan again")
        cfg = config_from_dict(schedule.config)
        beat.interval_seconds = beat_interval_seconds(cfg.run.collective_timeout_seconds)
        beat.doing("start-up: waiting for every rank to join torch.distributed", waiting=True)
        init_torch_distributed(control, cfg.run.collective_timeout_seconds,
                               startup_timeout_seconds=cfg.run.startup_timeout_seconds)
        beat.reached("ranks up")
        torch.manual_seed(cfg.seed * 1000 + control.rank)
        if resume == "if-any" and checkpoint_dir.latest(trial_dir) is None:
            resume = ""
        beat.doing("start-up: reading the tokenizer and data set, measuring the clock offset to rank 0")
        data = RunData.read(control, cfg, schedule)
        device = rank_device()
        graph, layouts = schedule.graph(), layouts_of(schedule)
        # Block placement, as the planner costed it: runtime plans equal the estimator's (same node_of).
        node_of = comm_budget.block_node_of(comm_budget.ranks_per_node(schedule))
        store = ModelStore(schedule, cfg, graph, control.rank, device, node_of)
        router = SampleRouter(graph, layouts, control.rank, node_of)
        # The evaluation routes by its own layouts where they differ (async mode: the actor answers at home).
        eval_layouts = data.eval_plan.layouts if data.eval_plan is not None else layouts
        eval_router = router if eval_layouts == layouts else SampleRouter(graph, eval_layouts, control.rank, node_of)
        master = Master(control, cfg, schedule, trial_dir, data.train_set, bool(resume)) if control.is_master else None
        # Every timestamp this rank reports is on the master's clock, taken once the device is idle.
        clock = Clock(measure_offset(control.comm), device)
        prepare_run_ops(control.comm, schedule.models.values(), doing=beat.doing)  # before any engine loads a compiled op
        beat.reached("compiled ops ready")
        beat.doing("start-up: creating process groups (with every rank)", waiting=True)
        parts = StepParts.make(control, cfg, schedule, data, store, router, eval_router, clock)
        beat.reached("process groups made")
        problem = schedule_problem(schedule, control.world_size)
        if problem:  # the planner proposes no such layout; a hand-made schedule may hold one
            raise LayoutError(problem)
        store.load(parts.groups, beat)
        store.build_engines(parts.groups, beat)
        start_step = 0
        if resume:
            beat.doing("start-up: loading the newest checkpoint")
            buffer = parts.async_ops.buffer if parts.async_ops is not None else None
            began = time.monotonic()
            start_step = ckpt.load(trial_dir, store, parts.groups, control, data.state, master, buffer)
            if master is not None:
                master.loaded(time.monotonic() - began)
            if parts.async_ops is not None:
                parts.async_ops.first_step = start_step
        beat.reached("ready")
        return cls(control, cfg, schedule, trial_dir, beat, data=data, store=store, parts=parts, master=master,
                   clock=clock, start_step=start_step)

    @property
    def async_ops(self) -> AsyncOps:
        assert self.parts.async_ops is not None, "async mode's ops (the schedule's execution is Async)"
        return self.parts.async_ops

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        step = self.start_step
        beat = self.heartbeat
        while True:
            beat.doing(f"step {step + 1}: waiting for the step's sample ids from rank 0", waiting=True)
            drawn = self.control.bcast(self._draw_ids() if self.master else None)
            if drawn is None:
                break
            # async mode: this step's ids and those of the steps generated ahead; sync mode: this step's
            ahead, ids = (drawn, drawn[step]) if isinstance(drawn, dict) else ({}, drawn)
            if self.master and step == self.start_step:  # every rank has passed start-up and this bcast
                print(f"restage: start-up: ready on all {self.control.world_size} ranks "
                      f"({time.monotonic() - beat.started_at:.1f} s since rank 0 started)", flush=True)
            started = self.clock.now_synced()
            record = self.run_step(step, ids, ahead)
            record.step_start_seconds, record.step_end_seconds = started, self.clock.now_synced()
            if self.eval_plan is not None and evaluation.eval_due(step + 1, self.cfg.run):
                self.evaluate(record, version=step + 1)  # after the step's end: evaluation is not iteration time
            beat.doing(f"step {step + 1}: waiting for every rank's end of the step", waiting=True)
            records = self.control.gather(record)
            decision = None
            if self.master:
                assert records is not None  # the master is gather's root: it gets every rank's record
                decision = self.master.end_step(step, records)
            decision = self.control.bcast(decision)
            step += 1
            if decision.checkpoint:
                beat.doing(f"step {step}: saving checkpoint step-{step}")
                began = time.monotonic()
                ckpt.save(self.trial_dir, step, self.store, self.groups, self.control, self.state, self.master,
                          self.cfg.run.keep_checkpoints,
                          self.parts.async_ops.buffer if self.parts.async_ops is not None else None)
                if self.master is not None:
                    self.master.saved(time.monotonic() - began)
            if decision.stop:
                break

    def _draw_ids(self) -> dict[int, list[int]] | list[int] | None:
        """The master's draw: this step's sample ids (sync mode), or those of the steps generation needs (async)."""
        assert self.master is not None
        return self.master.next_ids() if self.ahead is None else self.master.ids_ahead(self.ahead)

    def run_step(self, step: int, ids: list[int], ahead: dict[int, list[int]] | None = None) -> StepRecord:
        """One iteration's ops on this rank; ``ahead`` (async mode) holds the ids of the steps generated ahead."""
        record = StepRecord(rank=self.rank, step=step)
        data = StepData(self.train_set)
        self.router.begin_step(ids, self.train_set)
        for op in self.ops:
            if self.rank not in op.ranks:
                continue
            if isinstance(op, SendKey) and data.waits_for(op.producer, op.key):
                # Rewards scored behind the ops since their generate MFC are first needed here: waiting for
                # them is still that MFC's work (not a wait on peers), and the heartbeat says so.
                self.heartbeat.doing(f"step {step + 1}: run {op.producer}")
                data.settle(op.producer)
            self.heartbeat.doing(f"step {step + 1}: {describe_op(op)}", waiting=isinstance(op, WITH_PEERS))
            match op:
                case Run():
                    self.handlers.run(op, step, data, record)
                case Generate():
                    self.async_ops.generate(op, step, data, ahead or {}, record)
                case TakeBuffered():
                    self.async_ops.take(op, step, data, record)
                case Push():
                    if self.async_ops.push_due(op, step):
                        begin = self.clock.now_synced()
                        sent = self.async_ops.push(op, step)
                        record.moves.append(MoveRecord(MoveKind.REALLOC, f"push:{op.model}", str(op.src), str(op.dst),
                                                       sent, begin, self.clock.now_synced()))
                case Realloc() | SendKey() | Free() | Offload() | Reload() | Ema():
                    self._move(op, record.moves, data, self.handlers)
                case _:
                    assert_never(op)
        data.settle()  # none left today (every reward key is sent somewhere); a reward's error still ends this step
        record.stats.extend(data.reward_stats)  # <mfc>/reward_timed_out, under a reward time limit
        return record

    def evaluate(self, record: StepRecord, version: int) -> None:
        """Answer every held-out prompt greedily and score it (runtime/step/evaluation.py): sums, span and the policy
        ``version`` evaluated (the actor's completed train steps) into ``record``."""
        plan = self.eval_plan
        assert plan is not None
        handlers = self.parts.eval_handlers
        begin = self.clock.now_synced()
        for index, positions in enumerate(plan.passes):
            data = StepData(self.eval_set)
            self.eval_router.begin_step(list(positions), self.eval_set)
            for op in evaluation.pass_ops(plan, index):
                if self.rank not in op.ranks:
                    continue
                self.heartbeat.doing(f"evaluation pass {index + 1}: {describe_op(op)}",
                                     waiting=isinstance(op, WITH_PEERS))
                if isinstance(op, Run):
                    evaluation.run_eval(handlers, op, data, record, plan, self.tokenizer, self.accuracy_fn)
                else:
                    self._move(op, None, data, handlers)  # not logged: the step's tables time the iteration only
        record.eval_span = Span(begin, self.clock.now_synced())
        record.eval_version = version

    def _move(self, op: Op, moves: list[MoveRecord] | None, data: StepData, handlers: OpHandlers) -> None:
        """Every op but ``run``, by ``handlers`` (the iteration's or the evaluation's); what moved is appended to
        ``moves`` (the step's log rows) unless it is None."""
        begin = self.clock.now_synced()
        match op:
            case Realloc():
                row = (MoveKind.REALLOC, op.model, handlers.realloc(op))
            case SendKey():
                row = (MoveKind.TRANSFER, op.key, handlers.transfer(op, data))
            case Ema():  # logged as a reallocation (it is one, plus the mix) named after the model it updates
                row = (MoveKind.REALLOC, f"ema:{op.model}", handlers.ema(op))
            case Free():
                self.store.free(op.model, op.layout)
                return
            case Offload():
                self.store.offload(op.model)
                return
            case Reload():
                self.store.reload(op.model)
                return
            case Run() | Generate() | TakeBuffered() | Push():
                raise AssertionError(f"{op} is run by the handlers, not moved")
            case _:
                assert_never(op)
        if moves is not None:
            kind, what, nbytes = row
            moves.append(MoveRecord(kind, what, str(op.src), str(op.dst), nbytes, begin, self.clock.now_synced()))

    def close(self) -> None:
        if self.context.scoring is not None:
            self.context.scoring.pool.close()
        if self.master is not None:
            self.master.close()
        self.heartbeat.doing("closing: waiting for every rank", waiting=True)
        dist.barrier()
        dist.destroy_process_group()


def describe_op(op: Op) -> str:
    """What an op does, for the heartbeat: its kind and the MFC, model or key it serves."""
    match op:
        case Run():
            return f"run {op.mfc}"
        case SendKey():
            return f"transfer {op.key} {op.producer} -> {op.mfc}"
        case Ema():
            return f"ema {op.model} for {op.mfc}"
        case Realloc() | Free() | Offload() | Reload() | Push():
            return f"{op.kind} {op.model}"
        case Generate():
            return f"generate {op.mfc} ahead" + (" (partial rollouts)" if op.partial else "")
        case TakeBuffered():
            return f"take {op.mfc}'s batch from the rollout buffer"
        case _:
            assert_never(op)
