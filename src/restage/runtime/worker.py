"""One rank of a run: its model shards, the iteration loop, and the ops it takes part in.

Start-up (the same on every rank): read the schedule, join torch.distributed, create every
process group the schedule needs (collectively, in one order; ``comm_budget`` says which and
bounds them), load each model's shard in its
home layout (each rank reads only its slices), wrap trainable ones in DeepSpeed. Then, every
iteration: the master's sample ids arrive over MPI, the ops run, at the ``run.eval_every`` cadence
the held-out prompts are evaluated (``runtime/evaluate.py``), records go back to the master, the
master's decision (checkpoint, stop) comes back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import assert_never

import torch
import torch.distributed as dist

from restage.algorithms import get_algorithm
from restage.algorithms.estimators import ema_mix_
from restage.algorithms.rewards import resolve_accuracy
from restage.config import ExperimentConfig, ModelSpec, config_from_dict
from restage.data.batch import Batch
from restage.data.datasets import default_tokenizer_dir, load_splits, sample_fields
from restage.data.tokenizer import load_tokenizer
from restage.errors import ConfigError, LayoutError
from restage.layout import Layout, ProcessGroups
from restage.models.checkpoint import load_stage
from restage.models.config import ModelConfig
from restage.models.decoder import StageModule
from restage.models.parallel import ParallelContext
from restage.runtime import checkpoint as ckpt
from restage.runtime import comm_budget, evaluate, nccl_rules
from restage.runtime.clock import Clock, measure_offset, peak_memory_bytes
from restage.runtime.control import Control, init_torch_distributed, wait_for_ranks
from restage.runtime.dataflow import DataFlow, measured_flops
from restage.runtime.engines import build_engine, engine_groups, mark_norm_ownership
from restage.runtime.execute import MFCResult, run_eval_generate, run_generate, run_inference, run_train
from restage.runtime.feasibility import schedule_problem
from restage.runtime.heartbeat import Heartbeat, beat_interval_seconds
from restage.runtime.master import Master
from restage.runtime.nccl_rules import rank_device
from restage.runtime.nonfinite import NonFiniteError, any_rank, nonfinite_samples, nonfinite_stats
from restage.runtime.offload import ModelCopy
from restage.runtime.ops import prepare_run_ops
from restage.runtime.realloc import execute_reallocation
from restage.runtime.records import MFCRecord, MoveRecord, Span, StatsShare, StepRecord
from restage.schedule.file import Schedule, read_schedule
from restage.schedule.ops import WITH_PEERS, Ema, Free, Offload, Op, Realloc, Reload, Run, SendKey
from restage.schedule.program import check_ema_architectures, ema_targets
from restage.schedule.realloc_plan import plan_reallocation

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ModelSlot:
    """One model as this rank sees it: its home shard (and engine) and any copies in other layouts."""

    name: str
    spec: ModelSpec
    cfg: ModelConfig
    home: Layout
    module: StageModule | None = None
    engine: object | None = None
    copies: dict[Layout, StageModule] = field(default_factory=dict)
    host_copy: ModelCopy | None = None  # a frozen model's home shard, offloaded between its MFCs

    def at(self, layout: Layout) -> StageModule:
        if layout == self.home:
            assert self.module is not None, f"rank holds no {self.name} shard in {layout}"
            return self.module
        return self.copies[layout]


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
        self.ema = ema_targets(self.graph)  # model updated by a reference EMA -> its train MFC
        self.tokenizer = load_tokenizer(default_tokenizer_dir(cfg))
        self.state = self.algo.init_state(cfg, self.tokenizer)
        self.train_set, self.eval_set = load_splits(cfg, self.tokenizer)
        self.state.sample_fields = sample_fields(self.train_set, self.eval_set)  # for the rewards' keywords
        self.source = self.train_set  # the split the running pass reads dataset keys from
        offloaded = frozenset(op.model for op in self.ops if isinstance(op, Offload))
        self.eval_plan = evaluate.plan_eval(self.graph, self.layouts, cfg, len(self.eval_set), offloaded)
        self.accuracy_fn = resolve_accuracy(cfg.reward_fn) if cfg.reward_fn else None
        self.device = rank_device()
        self.slots: dict[str, ModelSlot] = {}
        self.realloc_plans = {}
        self.frozen_copies: set[tuple[str, Layout]] = set()  # (model, layout) copies of frozen models already made
        # Block placement, as the planner costed it: runtime plans equal the estimator's (same node_of).
        self.node_of = comm_budget.block_node_of(comm_budget.ranks_per_node(schedule))
        self.dataflow = DataFlow(self.graph, self.layouts, self.rank, self.node_of)
        self.groups: ProcessGroups | None = None
        self.communicator_bound: comm_budget.CommunicatorBound | None = None  # set with the groups
        self.master = Master(control, cfg, schedule, trial_dir, self.train_set, bool(resume)) if control.is_master else None
        self.start_step = 0
        self.resume = resume
        self.skipped: dict[str, int] = {}  # train MFC -> consecutive steps skipped for non-finite inputs
        # Every timestamp this rank reports is on the master's clock, taken once the device is idle.
        self.clock = Clock(measure_offset(control.comm), self.device)

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
        if resume == "if-any" and ckpt.checkpoint_dir.latest(trial_dir) is None:
            resume = ""
        beat.doing("start-up: reading the tokenizer and data set, measuring the clock offset to rank 0")
        worker = cls(control, cfg, schedule, trial_dir, resume, beat)
        prepare_run_ops(control.comm, schedule.models.values(), doing=beat.doing)  # before any engine loads a compiled op
        beat.reached("compiled ops ready")
        beat.doing("start-up: creating process groups (with every rank)", waiting=True)
        worker._create_groups()
        beat.reached("process groups made")
        worker._load_models()
        worker._build_engines()
        if resume:
            beat.doing("start-up: loading the newest checkpoint")
            worker.start_step = ckpt.load(worker)
        beat.reached("ready")
        return worker

    def _model_cfg(self, name: str) -> ModelConfig:
        return self.schedule.models[name].arch

    def _create_groups(self) -> None:
        """The run's process groups (``comm_budget.run_groups``: layouts and one per reallocation; singletons
        only where DeepSpeed needs them); data transfers use the MPI communicators made here, not groups."""
        bound = comm_budget.communicator_bound(self.schedule, self._realloc_plan)
        if self.control.is_master:
            print(f"restage: {bound.summary()}", flush=True)
        self.communicator_bound = bound
        nccl_rules.set_bound(max_groups=bound.max_communicators, max_pairs=bound.max_pairs)  # when the checks are on
        self.groups = ProcessGroups(comm_budget.run_groups(self.layouts.values(), self.ops),
                                    singletons=comm_budget.singleton_ranks(self.schedule),
                                    timeout_seconds=self.cfg.run.collective_timeout_seconds,
                                    startup_timeout_seconds=self.cfg.run.startup_timeout_seconds)
        eval_ops = list(self.eval_plan.ops) if self.eval_plan is not None else []
        self.dataflow.create_comms(self.ops + eval_ops, self.control.comm)

    def _realloc_plan(self, model: str, src: Layout, dst: Layout):
        key = (model, src, dst)
        if key not in self.realloc_plans:
            cfg = comm_budget.realloc_model_config(self.schedule, self.cfg, model)
            self.realloc_plans[key] = plan_reallocation(cfg, src, dst, node_of=self.node_of,
                                                        bytes_per_element=DTYPES[self.schedule.models[model].dtype].itemsize)
        return self.realloc_plans[key]

    def _load_models(self) -> None:
        check_ema_architectures(self.graph, {name: self._model_cfg(name) for name in self.schedule.models})
        problem = schedule_problem(self.schedule, self.cfg, self.control.world_size)
        if problem:  # the planner proposes no such layout; a hand-made schedule may hold one
            raise LayoutError(problem)
        for name, info in self.schedule.models.items():
            spec = self.cfg.models[name]  # optimizer settings and init_critic_from_lm; the schedule has the rest
            home = info.home_layout
            cfg = self._model_cfg(name)
            critic = comm_budget.is_critic(name, spec, cfg)
            slot = ModelSlot(name, spec, cfg.as_critic() if critic and not cfg.is_critic else cfg, home)
            if self.rank in home:
                self.heartbeat.doing(f"start-up: loading {name} ({info.path})")
                slot.module = load_stage(info.path, home, self.groups, self.rank, DTYPES[info.dtype], self.device,
                                         critic=critic)
                slot.cfg = slot.module.cfg
                if not info.trainable:
                    slot.module.requires_grad_(False)
                    slot.module.eval()
            self.slots[name] = slot
        self.heartbeat.reached("models loaded")

    def _build_engines(self) -> None:
        """A DeepSpeed engine over each trainable model's home layout (collective over its ranks, in model order)."""
        for name, slot in self.slots.items():
            if slot.module is None or not slot.spec.trainable:
                continue
            self.heartbeat.doing(f"start-up: building {name}'s DeepSpeed engine (with its ranks)", waiting=True)
            train_mfc = next(m for m in self.graph if m.model == name and m.kind == "train_step")
            optimizer_steps = self.cfg.run.steps * train_mfc.minibatches * train_mfc.epochs
            _mark_norm(slot.module)
            slot.engine = build_engine(slot.module, slot.spec, slot.home, self.rank, self.groups,
                                       train_mfc.micro_batches, optimizer_steps)
            slot.module.eval()
        self.heartbeat.reached("engines built")

    # -- the loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        step = self.start_step
        beat = self.heartbeat
        while True:
            beat.doing(f"step {step + 1}: waiting for the step's sample ids from rank 0", waiting=True)
            ids = self.control.bcast(self.master.next_ids() if self.master else None)
            if ids is None:
                break
            if self.master and step == self.start_step:  # every rank has passed start-up and this bcast
                print(f"restage: start-up: ready on all {self.control.world_size} ranks "
                      f"({time.monotonic() - beat.started_at:.1f} s since rank 0 started)", flush=True)
            started = self.clock.now_synced()
            record = self.run_step(step, ids)
            record.step_start_seconds, record.step_end_seconds = started, self.clock.now_synced()
            if self.eval_plan is not None and evaluate.eval_due(step + 1, self.cfg.run):
                self.evaluate(record)  # after the step's end: evaluation is not iteration time
            beat.doing(f"step {step + 1}: waiting for every rank's end of the step", waiting=True)
            records = self.control.gather(record)
            decision = self.control.bcast(self.master.end_step(step, records) if self.master else None)
            step += 1
            if decision.checkpoint:
                beat.doing(f"step {step}: saving checkpoint step-{step}")
                ckpt.save(self, step)
            if decision.stop:
                break

    def run_step(self, step: int, ids: list[int]) -> StepRecord:
        record = StepRecord(rank=self.rank, step=step)
        self.outputs: dict[str, Batch] = {}
        self.inputs: dict[str, list[Batch]] = {}
        self.source = self.train_set
        self.dataflow.begin_step(ids, self.train_set)
        for op in self.ops:
            if self.rank not in op.ranks:
                continue
            self.heartbeat.doing(f"step {step + 1}: {describe_op(op)}", waiting=isinstance(op, WITH_PEERS))
            if isinstance(op, Run):
                self._run(op, step, record)
            else:
                self._move(op, record.moves)
        return record

    def evaluate(self, record: StepRecord) -> None:
        """Answer every held-out prompt greedily and score it (runtime/evaluate.py): sums and span into ``record``."""
        plan = self.eval_plan
        assert plan is not None
        begin = self.clock.now_synced()
        self.source = self.eval_set
        for index, positions in enumerate(plan.passes):
            self.outputs, self.inputs = {}, {}
            self.dataflow.begin_step(list(positions), self.eval_set)
            for op in evaluate.pass_ops(plan, index):
                if self.rank not in op.ranks:
                    continue
                self.heartbeat.doing(f"evaluation pass {index + 1}: {describe_op(op)}",
                                     waiting=isinstance(op, WITH_PEERS))
                if isinstance(op, Run):
                    self._run_eval(op, record)
                else:
                    self._move(op, None)  # not logged: the step's tables time the iteration only
        self.source = self.train_set
        record.eval_span = Span(begin, self.clock.now_synced())

    def _run_eval(self, op: Run, record: StepRecord) -> None:
        plan = self.eval_plan
        mfc = self.graph[op.mfc]
        layout = self.layouts[mfc.name]
        module = self.slots[mfc.model].at(layout)
        ctx = ParallelContext.from_layout(layout, self.groups, self.rank)
        batch = self._input_batch(mfc, layout, ctx.coord.dp)
        ids_key, mask_key = plan.generate.outputs[:2]
        rewards = None
        if mfc.kind == "generate":
            answered = self.outputs[mfc.name] = run_eval_generate(module, mfc, batch, self.cfg)
        else:  # the reward model: its input holds the answers
            answered, rewards = batch, run_inference(module, mfc, batch, self.algo, self.cfg, self.state).batch["rewards"]
        scoring = (plan.reward or plan.generate).name == mfc.name
        if scoring and ctx.coord.tp == 0 and ctx.coord.pp == ctx.strategy.pp - 1:  # one reporter per DP replica
            correct = None
            if rewards is None:
                rewards, correct = evaluate.rule_scores(answered, self.state.reward_fn, self.accuracy_fn,
                                                        self.tokenizer, ids_key, mask_key, self.state.sample_fields,
                                                        self.cfg.rewards)
            for key, value in evaluate.score_sums(answered, mask_key, rewards, correct).items():
                record.eval_sums[key] = record.eval_sums.get(key, 0.0) + value

    def _move(self, op: Op, moves: list[MoveRecord] | None) -> None:
        """Every op but ``run``; what moved is appended to ``moves`` (the step's log rows) unless it is None."""
        begin = self.clock.now_synced()
        match op:
            case Realloc():
                row = ("realloc", op.model, self._realloc(op))
            case SendKey():
                row = ("transfer", op.key, self._transfer(op))
            case Ema():  # logged as a reallocation (it is one, plus the mix) named after the model it updates
                row = ("realloc", f"ema:{op.model}", self._ema(op))
            case Free():
                self.slots[op.model].copies.pop(op.layout, None)
                self.frozen_copies.discard((op.model, op.layout))
                return
            case Offload() | Reload():
                slot = self.slots[op.model]
                if slot.module is not None:
                    if slot.host_copy is None:
                        slot.host_copy = ModelCopy(slot.name, slot.module, trainable=False)
                    if isinstance(op, Offload):
                        slot.host_copy.offload()
                    else:
                        slot.host_copy.reload(self.device)
                return
            case Run():
                raise AssertionError(f"{op} is run by _run, not moved")
            case _:
                assert_never(op)
        if moves is not None:
            kind, what, nbytes = row
            moves.append(MoveRecord(kind, what, str(op.src), str(op.dst), nbytes, begin, self.clock.now_synced()))

    def _run(self, op: Run, step: int, record: StepRecord) -> None:
        mfc = self.graph[op.mfc]
        slot = self.slots[mfc.model]
        layout = self.layouts[mfc.name]
        ctx = ParallelContext.from_layout(layout, self.groups, self.rank)
        batch = self._input_batch(mfc, layout, ctx.coord.dp)
        seed = (self.cfg.seed * 1_000_003 + step) * 101 + ctx.coord.dp
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        begin = self.clock.now_synced()
        if mfc.kind == "generate":
            result = run_generate(slot.at(layout), mfc, batch, self.algo, self.cfg, self.state, seed)
        elif mfc.kind == "inference":
            result = run_inference(slot.at(layout), mfc, batch, self.algo, self.cfg, self.state)
        else:
            # Checked before prepare_train too: it folds rewards into algorithm state (normalisers, KL control).
            skip = self._nonfinite_inputs(mfc, layout, batch, step)
            if not skip:
                batch, prep_stats = self.algo.prepare_train(batch, self.cfg, self.state, step, self._dp_reduce(ctx))
                skip = self._nonfinite_inputs(mfc, layout, batch, step)
            if skip:
                result = MFCResult(None, {f"{mfc.name}/skipped_nonfinite": 1.0}, 0)
            else:
                with engine_groups(slot.engine):
                    result = run_train(slot.engine, mfc, batch, self.algo, self.cfg, self.state, seed)
                result.stats.update({f"{mfc.name}/{k}": v for k, v in prep_stats.items()})
                if bad := nonfinite_stats(result.stats):
                    raise NonFiniteError(f"step {step + 1}: {mfc.name} trained on finite inputs but its "
                                         f"{', '.join(bad)} is not finite; its weights are not saved (the newest "
                                         "checkpoint is the last finite one)")
        end = self.clock.now_synced()
        if result.batch is not None:
            self.outputs[mfc.name] = result.batch
        peak = peak_memory_bytes(self.device)
        flops = measured_flops(mfc, slot.cfg, result.batch if result.batch is not None else batch, result.tokens)
        flops /= layout.strategy.tp * layout.strategy.pp  # this rank's share of its replica's work
        tokens = result.tokens // (layout.strategy.tp * layout.strategy.pp)
        record.mfcs.append(MFCRecord(mfc.name, mfc.model, mfc.kind, begin, end, tokens, flops, peak))
        if ctx.coord.tp == 0 and ctx.coord.pp == ctx.strategy.pp - 1:  # one reporter per DP replica
            record.stats.append(StatsShare(result.stats, batch.n_samples))

    def _nonfinite_inputs(self, mfc, layout: Layout, batch: Batch, step: int) -> bool:
        """Whether this train MFC skips the step: NaN or inf in its inputs on any of its ranks (runtime/nonfinite.py)."""
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

    def _dp_reduce(self, ctx: ParallelContext):
        if ctx.strategy.dp == 1:
            return None
        return dp_reducer(self.groups.get(ctx.dp_ranks), self.device)

    def _input_batch(self, mfc, layout: Layout, dp_rank: int) -> Batch:
        """This DP rank's slice of the MFC's inputs: dataset keys read locally, the rest as transferred."""
        parts: list[Batch] = []
        source = [k for k in mfc.inputs if self.graph.producer(k) is None]
        if source:
            positions = self.dataflow.dataset_positions(mfc, dp_rank)
            parts.append(self.source.batch(positions).only(source))
        parts += self.inputs.get(mfc.name, [])
        return _merge(parts)

    # -- data and parameter movement -------------------------------------------------------------------
    def _realloc(self, op: Realloc) -> int:
        slot = self.slots[op.model]
        plan = self._realloc_plan(op.model, op.src, op.dst)
        frozen = not slot.spec.trainable and op.model not in self.ema  # its weights never change
        if frozen and (op.model, op.dst) in self.frozen_copies:
            # Its copy never goes stale. Decided from what every rank of the op knows (not from holding
            # the copy, which only destination ranks do): a sender must not send what no one receives.
            return 0
        source = slot.engine if slot.engine is not None else slot.module
        # The copy is read-only and dropped before its source next changes (a trained model's after
        # its last use, a reference's once its EMA moves), so tensors this rank holds whole are shared.
        # The executor allocates the rest; the module adopts the tensors (built on "meta", it holds none).
        result = reallocate_when_ready(plan, source if self.rank in op.src else None, self.groups,
                                       self.cfg.run.peer_wait_timeout_seconds, dtype=DTYPES[slot.spec.dtype],
                                       share_local=True, device=self.device)
        if frozen:
            self.frozen_copies.add((op.model, op.dst))
        if self.rank in op.dst:
            ctx = ParallelContext.from_layout(op.dst, self.groups, self.rank)
            module = StageModule(slot.cfg, ctx, DTYPES[slot.spec.dtype], torch.device("meta"))
            module.load_state_dict(result.state, strict=True, assign=True)
            module.requires_grad_(False)
            module.eval()
            slot.copies[op.dst] = module
        return result.stats.sent_bytes

    def _ema(self, op: Ema) -> int:
        """``op.model <- (1 - eta) op.model + eta trained``: reallocate the trained model into the reference's home, mix."""
        mfc = self.graph[op.mfc]
        trained, target = self.slots[mfc.model], self.slots[op.model]
        plan = self._realloc_plan(mfc.model, op.src, op.dst)
        source = trained.engine if self.rank in op.src else None
        result = reallocate_when_ready(plan, source, self.groups, self.cfg.run.peer_wait_timeout_seconds,
                                       dtype=DTYPES[trained.spec.dtype], share_local=True)
        if self.rank in op.dst:
            eta = float(mfc.options["ref_ema_eta"])
            params = dict(target.module.named_parameters())
            for name, mixed_in in result.state.items():
                ema_mix_(params[name].data, mixed_in.to(params[name].device), eta)  # where it lives now (maybe host)
            if target.host_copy is not None:
                target.host_copy.changed()
        return result.stats.sent_bytes

    def _transfer(self, op: SendKey) -> int:
        mine = self.outputs.get(op.producer)
        received, nbytes = self.dataflow.execute(op, mine)
        if received is not None:
            self.inputs.setdefault(op.mfc, []).append(received)
        return nbytes

    def close(self) -> None:
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
        case Realloc() | Free() | Offload() | Reload():
            return f"{op.kind} {op.model}"
        case _:
            assert_never(op)


def dp_reducer(group, device: torch.device):
    """Sum over the DP group: tensors computed on the host go to the rank's device for the collective and come back."""

    def reduce(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(device, copy=True)  # NCCL has no host backend; copy: the caller's tensor stays as it was
        dist.all_reduce(out, group=group)
        return out.to(tensor.device)

    return reduce


def reallocate_when_ready(plan, source, groups: ProcessGroups, peer_wait_timeout_seconds: float, **options):
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


def _mark_norm(module: StageModule) -> None:
    from restage.layout import Strategy
    from restage.models.sharding import shard_specs

    ctx = module.ctx
    specs = shard_specs(module.cfg, Strategy(tp=ctx.tp_size, pp=ctx.pp_size), ctx.pp_stage, ctx.tp_rank)
    replicated = {s.param.name for s in specs if s.param.split_dim is None}
    duplicate = {"embed.weight"} if (module.tied_head and ctx.pp_size > 1 and not ctx.is_first_stage) else set()
    mark_norm_ownership(module, ctx.tp_rank, replicated, duplicate)


