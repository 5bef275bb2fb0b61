"""The schedule: an execution plan as one JSON file that every rank reads (format in docs/plan.md).

``plan.schedule.build_schedule`` writes a chosen plan down with everything the runtime needs and
nothing it must recompute: the config, the cluster, the execution mode (``execution.py``), each model as
the planner resolved it (``model_entry.ModelEntry``), each MFC with its layout and micro-batch count
(``MFCEntry``), the steps of one iteration in execution order (``Step``: an op of ``ops.py`` and
its predictions), and the estimator's predictions (``predictions.py``). This module is the file's one reader
and writer; ``read_schedule`` reads version 1 files (``legacy.py``) and refuses other versions.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from restage.cluster import ClusterSpec
from restage.disk import replace_atomically
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph
from restage.layout import Layout
from restage.schedule.execution import Execution, execution_from_json, execution_to_json
from restage.schedule.legacy import upgrade_v1
from restage.schedule.model_entry import ModelEntry
from restage.schedule.ops import Op, op_from_json, op_to_json
from restage.schedule.predictions import IterationPrediction, MFCPrediction, PlanFacts, SpanPrediction

# 2: the execution mode, each model's optimizer, value head and router loss weight, typed cluster and predictions.
# Version 1 files are read (schedule/legacy.py).
SCHEDULE_FORMAT_VERSION = 2

__all__ = ["SCHEDULE_FORMAT_VERSION", "MFCEntry", "ModelEntry", "Schedule", "Step", "read_schedule", "write_schedule"]

_MFC_FIELDS = tuple(f.name for f in dataclasses.fields(MFC))


@dataclass(frozen=True)
class MFCEntry:
    """One MFC (its ``micro_batches`` the plan's), the layout it runs on, and the estimator's predictions."""

    mfc: MFC
    layout: Layout
    predicted: MFCPrediction

    def to_json(self) -> dict[str, Any]:
        return self.mfc.to_json() | {"layout": self.layout.to_json(), "predicted": self.predicted.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MFCEntry:
        return cls(MFC.from_json({k: data[k] for k in _MFC_FIELDS}), Layout.from_json(data["layout"]),
                   MFCPrediction.from_json(data["predicted"]))


@dataclass(frozen=True)
class Step:
    """One op of the iteration, with its predicted span (none for a free) and the bytes it moves (where it moves any)."""

    op: Op
    predicted: SpanPrediction | None = None
    bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = op_to_json(self.op)
        if self.predicted is not None:
            out["predicted"] = self.predicted.to_json()
        if self.bytes is not None:
            out["bytes"] = self.bytes
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Step:
        predicted = SpanPrediction.from_json(data["predicted"]) if "predicted" in data else None
        return cls(op_from_json(data), predicted, data.get("bytes"))


@dataclass(frozen=True)
class Schedule:
    format_version: int
    experiment: str
    trial: str
    # The experiment config as the user wrote it (resolved; under plan.execution auto, the chosen mode's): the
    # runtime reads from it only what the planner does not decide (data, rewards, algorithm, run options).
    config: dict[str, Any]
    cluster: ClusterSpec
    world_size: int
    execution: Execution
    models: dict[str, ModelEntry]
    mfcs: tuple[MFCEntry, ...]
    steps: tuple[Step, ...]  # in execution order
    predicted: IterationPrediction
    plan: PlanFacts

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return out | {"cluster": self.cluster.to_json(), "execution": execution_to_json(self.execution),
                      "models": {name: m.to_json() for name, m in self.models.items()},
                      "mfcs": [e.to_json() for e in self.mfcs], "steps": [s.to_json() for s in self.steps],
                      "predicted": self.predicted.to_json(), "plan": self.plan.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Schedule:
        version = data.get("format_version")
        if version == 1:
            data, version = upgrade_v1(data), SCHEDULE_FORMAT_VERSION
        if version != SCHEDULE_FORMAT_VERSION:
            raise ConfigError(f"schedule format_version {version!r} is not {SCHEDULE_FORMAT_VERSION}; "
                              f"run `restage plan` again with this version of restage")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data))
        if missing:
            raise ConfigError(f"schedule lacks {missing}; run `restage plan` again")
        values = {k: data[k] for k in fields}
        return cls(**values | {"cluster": ClusterSpec.from_json(data["cluster"]),
                               "execution": execution_from_json(data["execution"]),
                               "models": {name: ModelEntry.from_json(m) for name, m in data["models"].items()},
                               "mfcs": tuple(MFCEntry.from_json(e) for e in data["mfcs"]),
                               "steps": tuple(Step.from_json(s) for s in data["steps"]),
                               "predicted": IterationPrediction.from_json(data["predicted"]),
                               "plan": PlanFacts.from_json(data["plan"])})

    def entry(self, name: str) -> MFCEntry:
        for entry in self.mfcs:
            if entry.mfc.name == name:
                return entry
        raise KeyError(name)

    def mfc(self, name: str) -> MFC:
        return self.entry(name).mfc

    def layout(self, name: str) -> Layout:
        return self.entry(name).layout

    def graph(self) -> DataflowGraph:
        """The MFCs in schedule order."""
        return DataflowGraph(tuple(e.mfc for e in self.mfcs))

    def ops(self) -> list[Op]:
        """The steps' ops, in the order every rank walks them."""
        return [s.op for s in self.steps]


def write_schedule(schedule: Schedule, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(path, (json.dumps(schedule.to_json(), indent=1) + "\n").encode())  # never half a file
    return path


def read_schedule(path: str | Path) -> Schedule:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"schedule {path} does not exist; run `restage plan CONFIG` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"schedule {path} is not valid JSON ({err.msg}); run `restage plan` again") from None
    return Schedule.from_json(data)
