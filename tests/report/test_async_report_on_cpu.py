"""What an async run's report, progress lines and timeline show (docs/report.md, "Async runs").

In async mode a step's generate rows are other steps' batches: the first step's warm-up generates ``ahead + 1``
batches, the last ``ahead`` steps none. The step's tokens are those of the batch it trains on (the one it takes
from the rollout buffer), and the default timeline is a step that runs every MFC, of median length.
"""

from __future__ import annotations

import numpy as np

from restage.report.log import read_log
from restage.report.log_writer import LogWriter
from restage.report.throughput import representative_step
from restage.runtime.control.master import step_tokens
from restage.runtime.control.records import MFCRecord, StepRecord


def _row(name: str, tokens: int) -> MFCRecord:
    kind = "generate" if name == "actor_gen" else "train_step" if name == "actor_train" else "inference"
    return MFCRecord(name, "actor", kind, 0.0, 1.0, tokens, 0.0, 0)


def test_an_async_step_counts_the_batch_it_took_not_the_batches_generated():
    # step 1 (ahead 1): the warm-up generates its own batch (300 tokens) and step 2's (320); it trains on 300
    first = [StepRecord(rank=0, mfcs=[_row("ref_inf", 300), _row("actor_train", 300)], step=0),
             StepRecord(rank=1, mfcs=[_row("actor_gen", 300), _row("actor_gen", 320)], step=0,
                        taken_tokens={"actor_gen": 300})]
    # the last step generates nothing; it trains on the 310 tokens generated a step before
    last = [StepRecord(rank=0, mfcs=[_row("ref_inf", 310), _row("actor_train", 310)], step=3),
            StepRecord(rank=1, mfcs=[], step=3, taken_tokens={"actor_gen": 310})]
    assert step_tokens(first, "actor_gen") == 300
    assert step_tokens(last, "actor_gen") == 310
    # two generation replicas (dp2) each report their half of the batch
    halves = [StepRecord(rank=r, mfcs=[], step=3, taken_tokens={"actor_gen": t}) for r, t in ((1, 150), (2, 160))]
    assert step_tokens(halves, "actor_gen") == 310


def test_a_sync_step_counts_its_generation_over_its_ranks():
    records = [StepRecord(rank=r, mfcs=[_row("actor_gen", 100 + r), _row("actor_train", 999)], step=0) for r in range(2)]
    assert step_tokens(records, "actor_gen") == 201


def _async_log(path, seconds: list[float]) -> LogWriter:
    """A 2-rank async-like log: actor_gen on rank 1 (twice at step 1, never at the last), the rest on rank 0."""
    writer = LogWriter(path, world_size=2, config={"experiment": "async"}, overwrite=True)
    clock = 100.0
    steps = len(seconds)
    for step, wall in enumerate(seconds, start=1):
        gens = 2 if step == 1 else (0 if step == steps else 1)
        for i in range(gens):
            writer.mfc(step, "actor_gen", "actor", "generate", 1, clock + 0.01 * i, clock + 0.01 * (i + 1), 300, 1.0, 0)
        for name in ("ref_inf", "actor_train"):
            writer.mfc(step, name, "actor", "inference", 0, clock, clock + wall / 2, 300, 1.0, 0)
        writer.end_step(step, clock, clock + wall, 8, 300, 1.0)
        clock += wall
    writer.close()
    return writer


def test_the_default_timeline_is_the_median_step_of_those_running_every_mfc(tmp_path):
    # step 5 (no generation) is the shortest and step 1 (two generations) the longest: neither is drawn
    _async_log(tmp_path / "log.h5", [0.30, 0.10, 0.12, 0.11, 0.05])
    log = read_log(tmp_path / "log.h5")
    assert log.last_complete_step == 5
    assert representative_step(log) == 4  # 0.11 s, the median of steps 2-4
    _async_log(tmp_path / "even.h5", [0.30, 0.10, 0.12, 0.11, 0.13, 0.05])
    assert representative_step(read_log(tmp_path / "even.h5")) == 4  # the lower middle of 0.10, 0.11, 0.12, 0.13


def test_a_one_step_log_draws_its_step(tmp_path):
    _async_log(tmp_path / "log.h5", [0.2])  # generates once (the warm-up's two batches) and trains
    log = read_log(tmp_path / "log.h5")
    assert representative_step(log) == 1
    assert np.array_equal(log.steps["step"], [1])
