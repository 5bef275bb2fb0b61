"""What crosses MPI each step is typed: the records pickle as mpi4py sends them, the master reads them by field
name, and a transfer's output metadata carries ``transfer.KeySpec``s built by ``KeySpec.of``."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch

from restage.data.batch import pack_sequences
from restage.graph import DataflowGraph
from restage.layout import Layout, Strategy
from restage.runtime.control.master import merge_eval, merge_stats
from restage.runtime.control.records import MFCRecord, MoveKind, MoveRecord, Span, StatsShare, StepDecision, StepRecord
from restage.runtime.dataplane import routing
from restage.runtime.dataplane.data_transfer import KeySpec


def _over_mpi(obj):
    return pickle.loads(pickle.dumps(obj))  # what mpi4py's lower-case calls do


def _record(rank: int, reward: float, samples: int, prompts: float, span: tuple[float, float]) -> StepRecord:
    record = StepRecord(rank=rank, step=3, step_start_seconds=1.0, step_end_seconds=2.5)
    record.mfcs.append(MFCRecord("actor_gen", "actor", "generate", 1.0, 1.5, 40, 2.0e9, 1 << 20))
    record.moves.append(MoveRecord(MoveKind.REALLOC, "actor", "ranks:0-1 dp2", "ranks:0-1 tp2", 4096, 1.5, 1.7))
    record.stats.append(StatsShare({"actor_train/reward": reward}, samples))
    record.eval_sums = {"reward": reward * prompts, "prompts": prompts}
    record.eval_span = Span(*span)
    record.eval_version = 4  # after step 4 (loop index 3): four train steps made the weights evaluated
    return record


def test_step_records_arrive_equal_and_are_read_by_name():
    records = [_record(0, 1.0, 3, 2.0, (3.0, 4.0)), _record(1, 3.0, 1, 6.0, (3.5, 4.5))]
    received = _over_mpi(records)
    assert received == records
    assert received[1].mfcs[0].tokens == 40 and received[1].moves[0].num_bytes == 4096
    assert received[0].eval_span.end_seconds == 4.0
    assert merge_stats(received) == {"actor_train/reward": (1.0 * 3 + 3.0 * 1) / 4}
    assert merge_eval(received) == {"eval/reward": (2.0 + 18.0) / 8.0, "eval/prompts": 8.0, "eval/seconds": 1.5,
                                    "eval/policy_version": 4.0}
    assert _over_mpi(StepDecision(checkpoint=True, stop=False)) == StepDecision(True, False)


def test_a_transfers_metadata_is_gathered_as_typed_parts(monkeypatch):
    # Producer "gen" over ranks 0, 1 (dp2): rank 0 holds samples 7, 8 and rank 1 holds sample 9.
    def part(ids, lengths):
        batch = pack_sequences([list(range(n)) for n in lengths], key="ids", ids=ids)
        return batch.with_keys(seqs={"rewards": torch.zeros(len(lengths), 2, dtype=torch.float32)})

    mine, theirs = part((7, 8), (3, 5)), part((9,), (4,))
    sent = []

    def allgather(comm, contribution):
        sent.append(contribution)
        other = routing.OutputPart(1, theirs.ids, theirs.seqlens, 1, KeySpec.of(theirs))
        return [_over_mpi(other), _over_mpi(contribution), None]  # None: a rank that holds no part

    monkeypatch.setattr(routing, "allgather", allgather)
    producer, consumer = Layout.contiguous(0, Strategy(dp=2)), Layout.contiguous(2, Strategy(dp=1))
    flow = routing.SampleRouter(DataflowGraph(()), {"gen": producer}, rank=0)
    flow._comms[(0, 1, 2)] = None
    op = SimpleNamespace(producer="gen", ranks=(0, 1, 2), src=producer, dst=consumer, key="rewards")
    meta = flow._gather_meta(op, mine)
    assert sent == [routing.OutputPart(0, (7, 8), (3, 5), 1, KeySpec.of(mine))]
    assert KeySpec.of(mine) == (KeySpec("ids", True, "int64"), KeySpec("rewards", False, "float32", (2,)))
    assert (meta.ids, meta.seqlens, meta.parts) == ((7, 8, 9), (3, 5, 4), ((0, 1), (2,)))
    plan = flow.plan(op, meta, "contiguous")
    assert plan.meta.keys == (KeySpec("rewards", False, "float32", (2,)),)
    assert plan.total_bytes == 3 * 2 * 4  # three samples' two float32 rewards, all to rank 2


def test_max_and_min_statistics_merge_by_their_extreme_not_by_a_mean():
    # A mean of two ranks' maxima (2.5) would depend on how the batch was cut; the step's largest ratio is 3.
    records = [StepRecord(rank=r, step=1, step_start_seconds=0.0, step_end_seconds=1.0) for r in (0, 1)]
    records[0].stats.append(StatsShare({"a/ratio_max": 2.0, "a/x_min": -1.0, "a/loss": 1.0}, 3))
    records[1].stats.append(StatsShare({"a/ratio_max": 3.0, "a/x_min": 0.5, "a/loss": 2.0}, 1))
    assert merge_stats(records) == {"a/loss": (1.0 * 3 + 2.0) / 4, "a/ratio_max": 3.0, "a/x_min": -1.0}
