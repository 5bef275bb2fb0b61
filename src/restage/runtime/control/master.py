"""The master role (rank 0): data cursor, log, progress line, and the checkpoint / stop decisions.

Tensors never come here; each step the master hands out sample ids and receives every rank's
records (MFC timings, moves, statistics) over MPI, writes them to ``log.h5`` and decides.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, assert_never

from restage.config.schema import ExperimentConfig
from restage.data.datasets import Cursor, Dataset
from restage.report import dashboards
from restage.report.log_writer import LogWriter
from restage.runtime.control.channels import Control
from restage.runtime.control.deadline import DeadlineWatch, deadline_from_env, write_time_limit
from restage.runtime.control.progress import Progress
from restage.runtime.control.records import MoveKind, StepDecision, StepRecord, merge_rule
from restage.schedule.file import Schedule


def merge_stats(records: list[StepRecord]) -> dict[str, float]:
    """Each statistic over the reporting ranks: the sample-weighted mean, or the extreme (``records.merge_rule``)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    extremes: dict[str, float] = {}
    for record in records:
        for share in record.stats:
            for key, value in share.stats.items():
                rule = merge_rule(key)
                if rule != "mean":
                    if share.samples > 0:
                        pick = max if rule == "max" else min
                        extremes[key] = pick(extremes.get(key, float(value)), float(value))
                    continue
                sums[key] = sums.get(key, 0.0) + float(value) * share.samples
                weights[key] = weights.get(key, 0.0) + share.samples
    means = {k: sums[k] / weights[k] for k in sums if weights[k] > 0}
    return dict(sorted({**means, **extremes}.items()))


def merge_eval(records: list[StepRecord]) -> dict[str, float]:
    """``eval/*`` statistics of an evaluation (runtime/step/evaluation.py): means over every held-out prompt, the
    number of prompts, its seconds (first rank in to last rank out) and the policy version evaluated; {} when
    the step had none."""
    totals: dict[str, float] = {}
    for record in records:
        for key, value in record.eval_sums.items():
            totals[key] = totals.get(key, 0.0) + value
    spans = [record.eval_span for record in records if record.eval_span is not None]
    if not spans:
        return {}
    prompts = totals.pop("prompts", 0.0)
    out = {f"eval/{key}": value / prompts for key, value in sorted(totals.items()) if prompts}
    out["eval/prompts"] = prompts
    out["eval/seconds"] = max(s.end_seconds for s in spans) - min(s.start_seconds for s in spans)
    versions = {record.eval_version for record in records if record.eval_span is not None}
    assert len(versions) == 1, f"ranks evaluated different policy versions: {sorted(versions)}"
    out["eval/policy_version"] = float(versions.pop())
    return out


def progress_stats(stats: dict[str, float]) -> dict[str, float]:
    """What the progress line shows: each loss, reward / kl / accuracy once (they appear under every train
    MFC), and the evaluation's reward and accuracy when the step evaluated."""
    shown: dict[str, float] = {}
    for key, value in stats.items():
        base = key.split("/")[-1]
        if key.startswith("eval/"):
            if base in ("reward", "accuracy"):
                shown[key] = value
        elif base in ("reward", "kl", "accuracy") and not any(k.endswith("/" + base) for k in shown):
            shown[key] = value
        elif base == "loss":
            shown[key] = value
    return shown


def step_tokens(records: list[StepRecord], first_mfc: str) -> int:
    """The tokens of the batch a step trains on (its step row's ``tokens``, the progress line's tokens/s).

    Sync mode: what the step's first MFC (the generation, where there is one) handled, summed over its ranks.
    Async mode: the batch the step took from the rollout buffer (``AsyncOps.take``). The generate rows of a step
    are another step's batches (the first step's warm-up generates ``ahead + 1`` of them, the last steps none), so
    counting them gave the first step several batches' tokens and the last ``0 tokens/s``."""
    taken = [record.taken_tokens[first_mfc] for record in records if first_mfc in record.taken_tokens]
    if taken:
        return sum(taken)
    return sum(m.tokens for r in records for m in r.mfcs if m.name == first_mfc)


class Master:
    def __init__(self, control: Control, cfg: ExperimentConfig, schedule: Schedule, trial_dir: Path, train_set: Dataset,
                 resume: bool):
        self.cfg, self.trial_dir, self.schedule = cfg, trial_dir, schedule
        self.cursor = Cursor(len(train_set), seed=cfg.seed, shuffle=cfg.dataset.shuffle)
        self.first_mfc = schedule.mfcs[0].mfc.name
        self.step = 0
        self.progress = Progress(cfg.run.steps)
        self.resume = resume
        self.log: LogWriter | None = None
        self.control = control
        self.drawn: dict[int, list[int]] = {}  # async mode: loop step -> sample positions drawn ahead of it
        # The attempt's end ($RESTAGE_DEADLINE, from the job driver) and the step and save times measured against it.
        self.deadline = DeadlineWatch(deadline_from_env(), cfg.run.save_before_end_seconds)
        self._step_began = time.monotonic()

    def open_log(self, resume_step: int | None) -> None:
        dtypes = {entry.dtype for entry in self.schedule.models.values()}  # the models the run holds
        self.log = LogWriter(self.trial_dir, world_size=self.control.world_size, config=self.cfg.to_yaml(),
                             schedule=self.schedule.to_json(), cluster=self.schedule.cluster.to_json(),
                             dtype=dtypes.pop() if len(dtypes) == 1 else "", resume_step=resume_step,
                             overwrite=resume_step is None)  # `restage run` refuses to start over a run unasked
        dashboards.attach(self.log, self.cfg, self.trial_dir, resume_step)

    def next_ids(self) -> list[int] | None:
        """Sample positions of the next step, or None when the run is done."""
        if self.log is None:
            # Checkpoint step-N holds N done steps, logged as steps 1..N: keep those rows, so rows written
            # after the checkpoint (a crash or scancel mid-run) are dropped and redone.
            self.open_log(self.step if self.resume else None)
        if self.step >= self.cfg.run.steps:
            return None
        self._step_began = time.monotonic()
        return self.cursor.next(self.cfg.run.batch_size)

    def ids_ahead(self, ahead: int) -> dict[int, list[int]] | None:
        """Async mode: the sample positions of this step and the ``ahead`` after it (within ``run.steps``), by loop
        step; each step's drawn from the cursor once, in step order, so they are those a sync run trains on."""
        if self.log is None:
            self.open_log(self.step if self.resume else None)
        if self.step >= self.cfg.run.steps:
            return None
        self._step_began = time.monotonic()
        for step in range(self.step, min(self.step + ahead + 1, self.cfg.run.steps)):
            if step not in self.drawn:
                self.drawn[step] = self.cursor.next(self.cfg.run.batch_size)
        self.drawn = {step: ids for step, ids in self.drawn.items() if step >= self.step}
        return dict(self.drawn)

    def end_step(self, step: int, records: list[StepRecord]) -> StepDecision:
        """Log the loop's step ``step`` (from 0) as step ``step + 1``: steps count from 1 in the log, the
        progress line and checkpoint names alike. Returns the decision every rank follows."""
        log = self.log
        assert log is not None
        done = step + 1
        for record in records:
            for m in record.mfcs:
                log.mfc(done, m.name, m.model, m.kind, record.rank, m.start_seconds, m.end_seconds, tokens=m.tokens,
                        flops=m.flops, peak_memory_bytes=m.peak_memory_bytes)
            for move in record.moves:
                match move.kind:
                    case MoveKind.REALLOC:
                        log.realloc(done, move.what, move.src, move.dst, move.num_bytes, move.start_seconds,
                                    move.end_seconds, rank=record.rank)
                    case MoveKind.TRANSFER:
                        log.transfer(done, move.what, move.src, move.dst, move.num_bytes, move.start_seconds,
                                     move.end_seconds, rank=record.rank)
                    case _:
                        assert_never(move.kind)
        stats = merge_stats(records) | merge_eval(records)
        if stats:
            log.stats(done, stats)
        start = min(r.step_start_seconds for r in records)
        end = max(r.step_end_seconds for r in records)
        tokens = step_tokens(records, self.first_mfc)
        flops = sum(m.flops for r in records for m in r.mfcs)
        samples = self.cfg.run.batch_size
        log.end_step(done, start, end, samples, tokens, flops)
        self.step = done
        print(self.progress.line(self.step, samples, tokens, end - start, progress_stats(stats)), flush=True)
        self.deadline.step_done(time.monotonic() - self._step_began)
        every = self.cfg.run.save_every
        last = self.step >= self.cfg.run.steps
        preempted = _preempt_requested(self.trial_dir) or self.step == self.cfg.run.stop_at_step
        if not last:  # also under PREEMPT: the driver's last resort before the limit creates it too
            before_limit = self.deadline.check(time.time())
            if before_limit is not None:  # the job driver requeues the job when the ranks have stopped
                print(f"restage: checkpointing at step {self.step} and stopping: {before_limit.describe()}", flush=True)
                write_time_limit(self.trial_dir, self.step, before_limit)
                preempted = True
        return StepDecision(checkpoint=last or preempted or (every > 0 and self.step % every == 0),
                            stop=last or preempted)

    def saved(self, seconds: float) -> None:
        """A checkpoint took ``seconds`` on this rank (the deadline rule's save estimate)."""
        self.deadline.saved(seconds)

    def loaded(self, seconds: float) -> None:
        """Loading the checkpoint at start-up took ``seconds`` (the save estimate until a save is timed)."""
        self.deadline.loaded(seconds)

    def checkpoint_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cursor": self.cursor.state_dict(), "step": self.step}
        if self.drawn:  # async mode: the steps drawn ahead, whose batches the generating ranks' buffers hold
            state["drawn"] = {str(step): ids for step, ids in sorted(self.drawn.items()) if step >= self.step}
        return state

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.drawn = {int(step): list(ids) for step, ids in state.get("drawn", {}).items()}
        self.cursor.load_state_dict(state["cursor"])
        self.step = int(state["step"])
        self.progress.first_step = self.step

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            print(f"log: {self.trial_dir / 'log.h5'}", flush=True)


def _preempt_requested(trial_dir: Path) -> bool:
    """SLURM's pre-timeout signal makes the job driver create this file (see docs/slurm.md)."""
    path = os.environ.get("RESTAGE_PREEMPT_FILE") or str(trial_dir / "PREEMPT")
    return Path(path).exists()

