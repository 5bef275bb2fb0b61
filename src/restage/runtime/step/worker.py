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
from pathlib import Path
from typing import assert_never

import torch
import torch.distributed as dist

from restage.algorithms.base import CallContext, RewardScoring
from restage.algorithms.interface import get_algorithm
from restage.algorithms.rewards import resolve_accuracy
from restage.algorithms.scoring import RewardPool
from restage.config.load import config_from_dict
from restage.config.schema import ExperimentConfig
from restage.data.datasets import cut_prompts_warning, default_tokenizer_dir, load_splits, sample_fields
from restage.data.tokenizer import load_tokenizer
from restage.device import rank_device
from restage.errors import ConfigError, LayoutError
from restage.layout import ProcessGroups
from restage.runtime.checkpoint import checkpoint_dir
from restage.runtime.checkpoint import run_state as ckpt
from restage.runtime.control.channels import Control, init_torch_distributed
from restage.runtime.control.clock import Clock, measure_offset
from restage.runtime.control.heartbeat import Heartbeat, beat_interval_seconds
from restage.runtime.control.master import Master
from restage.runtime.control.records import MoveRecord, Span, StepRecord
from restage.runtime.dataplane import comm_budget
from restage.runtime.dataplane.routing import SampleRouter
from restage.runtime.step import evaluation
from restage.runtime.step.async_ops import AsyncOps
from restage.runtime.step.op_handlers import OpHandlers, StepData
from restage.runtime.store.deepspeed_ops import prepare_run_ops
from restage.runtime.store.feasibility import schedule_problem
from restage.runtime.store.model_store import ModelStore
from restage.schedule.async_program import steps_drawn_ahead
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


class Worker:
    """Everything one rank does in a run."""

    def __init__(self, control: Control, cfg: ExperimentConfig, schedule: Schedule, trial_dir: Path, resume: str,
                 heartbeat: Heartbeat):
        self.control, self.cfg, self.schedule, self.trial_dir = control, cfg, schedule, trial_dir
        self.heartbeat = heartbeat  # what this rank is doing, for the launcher's watchdog
        self.rank = control.rank
        self.ops = schedule.ops()
        self.graph = schedule.graph()
        self.layouts = {m.name: schedule.layout(m.name) for m in self.graph}
        self.algo = get_algorithm(cfg.algorithm)
        self.tokenizer = load_tokenizer(default_tokenizer_dir(cfg))
        self.state = self.algo.init_state(cfg, self.tokenizer)
        self.train_set, self.eval_set = load_splits(cfg, self.tokenizer)
        if control.is_master and (warning := cut_prompts_warning(cfg, self.train_set, self.eval_set)):
            print(f"restage: {warning}", flush=True)  # once per run, before the first step
        # What every algorithm call is told: the samples' dataset fields (the rewards' keywords) and the pool rewards
        # score on behind the next ops (op_handlers); a train step adds its policy version.
        self.context = CallContext(sample_fields=sample_fields(self.train_set, self.eval_set),
                                   scoring=RewardScoring(RewardPool(cfg.rewards.workers)))
        offloaded = frozenset(op.model for op in self.ops if isinstance(op, Offload))
        self.eval_plan = evaluation.plan_eval(self.graph, self.layouts, cfg, len(self.eval_set), offloaded)
        self.accuracy_fn = resolve_accuracy(cfg.reward_fn) if cfg.reward_fn else None
        device = rank_device()
        # Block placement, as the planner costed it: runtime plans equal the estimator's (same node_of).
        node_of = comm_budget.block_node_of(comm_budget.ranks_per_node(schedule))
        self.store = ModelStore(schedule, cfg, self.graph, self.rank, device, node_of)
        self.router = SampleRouter(self.graph, self.layouts, self.rank, node_of)
        # The evaluation routes by its own layouts where they differ (async mode: the actor answers at home).
        eval_layouts = self.eval_plan.layouts if self.eval_plan is not None else self.layouts
        self.eval_router = (self.router if eval_layouts == self.layouts
                            else SampleRouter(self.graph, eval_layouts, self.rank, node_of))
        self._groups: ProcessGroups | None = None  # made at start-up, with every rank (_create_groups)
        self._handlers: OpHandlers | None = None  # made with the groups
        self._eval_handlers: OpHandlers | None = None  # the evaluation's: over eval_router and its layouts
        self.asynchronous = cfg.plan.execution == "async"
        # async mode: the steps past this one whose ids generation needs (schedule/async_program.py)
        self.ahead = steps_drawn_ahead(cfg.plan.staleness, cfg.plan.push_every, cfg.plan.partial_rollouts)
        self._async: AsyncOps | None = None  # async mode's ops, made with the handlers
        self.master = Master(control, cfg, schedule, trial_dir, self.train_set, bool(resume)) if control.is_master else None
        self.start_step = 0
        # Every timestamp this rank reports is on the master's clock, taken once the device is idle.
        self.clock = Clock(measure_offset(control.comm), device)

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
        worker = cls(control, cfg, schedule, trial_dir, resume, beat)
        prepare_run_ops(control.comm, schedule.models.values(), doing=beat.doing)  # before any engine loads a compiled op
        beat.reached("compiled ops ready")
        beat.doing("start-up: creating process groups (with every rank)", waiting=True)
        worker._create_groups()
        beat.reached("process groups made")
        problem = schedule_problem(schedule, cfg, control.world_size)
        if problem:  # the planner proposes no such layout; a hand-made schedule may hold one
            raise LayoutError(problem)
        worker.store.load(worker.groups, beat)
        worker.store.build_engines(worker.groups, beat)
        if resume:
            beat.doing("start-up: loading the newest checkpoint")
            buffer = worker._async.buffer if worker._async is not None else None
            began = time.monotonic()
            worker.start_step = ckpt.load(trial_dir, worker.store, worker.groups, control, worker.state, worker.master,
                                          buffer)
            if worker.master is not None:
                worker.master.loaded(time.monotonic() - began)
            if worker._async is not None:
                worker._async.first_step = worker.start_step
        beat.reached("ready")
        return worker

    def _create_groups(self) -> None:
        """The run's process groups (``comm_budget.run_groups``: layouts and one per reallocation; singletons
        only where DeepSpeed needs them); data transfers use the MPI communicators made here, not groups."""
        bound = comm_budget.communicator_bound(self.schedule, self.store.realloc_plan)
        if self.control.is_master:
            print(f"restage: {bound.summary()}", flush=True)
        nccl_rules.set_bound(max_groups=bound.max_communicators, max_pairs=bound.max_pairs)  # when the checks are on
        groups = ProcessGroups(comm_budget.run_groups(self.layouts.values(), self.ops),
                               singletons=comm_budget.singleton_ranks(self.schedule),
                               timeout_seconds=self.cfg.run.collective_timeout_seconds,
                               startup_timeout_seconds=self.cfg.run.startup_timeout_seconds)
        self._groups = groups
        eval_ops = list(self.eval_plan.ops) if self.eval_plan is not None else []
        if self.eval_router is self.router:
            self.router.create_comms(self.ops + eval_ops, self.control.comm)
        else:  # every rank splits in the same order: the iteration's communicators, then the evaluation's
            self.router.create_comms(self.ops, self.control.comm)
            self.eval_router.create_comms(eval_ops, self.control.comm)
        self._handlers = OpHandlers(self.store, groups, self.router, self.clock, self.layouts, self.cfg,
                                    self.algo, self.state, self.context)
        self._eval_handlers = self._handlers
        if self.eval_router is not self.router:
            self._eval_handlers = OpHandlers(self.store, groups, self.eval_router, self.clock,
                                             self.eval_router.layouts, self.cfg, self.algo, self.state, self.context)
        if self.asynchronous:
            self._async = AsyncOps(self._handlers, first_step=0)

    @property
    def groups(self) -> ProcessGroups:
        assert self._groups is not None, "the process groups are made at start-up (Worker.start)"
        return self._groups

    @property
    def async_ops(self) -> AsyncOps:
        assert self._async is not None, "async mode's ops are made with the handlers (plan.execution async)"
        return self._async

    @property
    def handlers(self) -> OpHandlers:
        assert self._handlers is not None, "the op handlers are made with the process groups (Worker.start)"
        return self._handlers

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        step = self.start_step
        beat = self.heartbeat
        while True:
            beat.doing(f"step {step + 1}: waiting for the step's sample ids from rank 0", waiting=True)
            drawn = self.control.bcast((self.master.ids_ahead(self.ahead) if self.asynchronous else self.master.next_ids())
                                       if self.master else None)
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
                          self.cfg.run.keep_checkpoints, self._async.buffer if self._async is not None else None)
                if self.master is not None:
                    self.master.saved(time.monotonic() - began)
            if decision.stop:
                break

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
                        record.moves.append(MoveRecord("realloc", f"push:{op.model}", str(op.src), str(op.dst), sent,
                                                       begin, self.clock.now_synced()))
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
        assert plan is not None and self._eval_handlers is not None
        handlers = self._eval_handlers
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
                row = ("realloc", op.model, handlers.realloc(op))
            case SendKey():
                row = ("transfer", op.key, handlers.transfer(op, data))
            case Ema():  # logged as a reallocation (it is one, plus the mix) named after the model it updates
                row = ("realloc", f"ema:{op.model}", handlers.ema(op))
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
