"""The schedule: an execution plan as one JSON file that every rank reads (format in docs/plan.md).

``plan.schedule.build_schedule`` writes a chosen plan down with everything the runtime needs and
nothing it must recompute: the config, the cluster, each model's architecture, checkpoint, dtype,
ZeRO stage and home layout (``ModelEntry``), each MFC with its layout and micro-batch count
(``MFCEntry``), the steps of one iteration in execution order (``Step``: an op of ``ops.py`` and
its predictions), and the estimator's predictions. This module is the file's one reader and
writer; ``read_schedule`` refuses files of another format version.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from restage.disk import replace_atomically
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.schedule.ops import Op, op_from_json, op_to_json

SCHEDULE_FORMAT_VERSION = 1

_MFC_FIELDS = tuple(f.name for f in dataclasses.fields(MFC))


@dataclass(frozen=True)
class ModelEntry:
    """One model as the run holds it: architecture, checkpoint, precision, ZeRO settings and home layout."""

    arch: ModelConfig
    path: str
    preset: str
    trainable: bool
    dtype: str
    zero_stage: int
    gradient_checkpointing: bool
    offload_optimizer: bool
    offload_params: bool
    offload_when_idle: bool
    home_mfc: str  # the MFC whose layout is the model's home
    home_layout: Layout
    # A frozen model held 1/dp per rank of its home layout (runtime/store/sharded_frozen.py); written only when set,
    # so the schedules of jobs without it are unchanged.
    shard_frozen: bool = False

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shard_frozen"}
        sharded = {"shard_frozen": True} if self.shard_frozen else {}
        return out | {"arch": self.arch.to_json(), "home_layout": self.home_layout.to_json()} | sharded

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelEntry:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data or f.name != "shard_frozen"}
        return cls(**values | {"arch": ModelConfig.from_json(data["arch"]),
                               "home_layout": Layout.from_json(data["home_layout"])})


@dataclass(frozen=True)
class MFCEntry:
    """One MFC (its ``micro_batches`` the plan's), the layout it runs on, and the estimator's predictions."""

    mfc: MFC
    layout: Layout
    predicted: dict[str, Any]  # seconds, peak_memory_bytes, start_seconds, end_seconds, source, breakdown

    def to_json(self) -> dict[str, Any]:
        return self.mfc.to_json() | {"layout": self.layout.to_json(), "predicted": self.predicted}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MFCEntry:
        return cls(MFC.from_json({k: data[k] for k in _MFC_FIELDS}), Layout.from_json(data["layout"]),
                   data["predicted"])


@dataclass(frozen=True)
class Step:
    """One op of the iteration, with its predicted span (none for a free) and the bytes it moves (where it moves any)."""

    op: Op
    predicted: dict[str, float] | None = None  # seconds, start_seconds, end_seconds
    bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        out = op_to_json(self.op)
        if self.predicted is not None:
            out["predicted"] = self.predicted
        if self.bytes is not None:
            out["bytes"] = self.bytes
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Step:
        return cls(op_from_json(data), data.get("predicted"), data.get("bytes"))


@dataclass(frozen=True)
class Schedule:
    format_version: int
    experiment: str
    trial: str
    config: dict[str, Any]
    cluster: dict[str, Any]
    world_size: int
    models: dict[str, ModelEntry]
    mfcs: tuple[MFCEntry, ...]
    steps: tuple[Step, ...]  # in execution order
    predicted: dict[str, Any]  # iteration_seconds, samples_per_second, flops_per_iteration, pflops_per_second, ...
    plan: dict[str, Any]  # mode, seed, search statistics, baselines

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return out | {"models": {name: m.to_json() for name, m in self.models.items()},
                      "mfcs": [e.to_json() for e in self.mfcs], "steps": [s.to_json() for s in self.steps]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Schedule:
        version = data.get("format_version")
        if version != SCHEDULE_FORMAT_VERSION:
            raise ConfigError(f"schedule format_version {version!r} is not {SCHEDULE_FORMAT_VERSION}; "
                              f"run `restage plan` again with this version of restage")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data))
        if missing:
            raise ConfigError(f"schedule lacks {missing}; run `restage plan` again")
        values = {k: data[k] for k in fields}
        return cls(**values | {"models": {name: ModelEntry.from_json(m) for name, m in data["models"].items()},
                               "mfcs": tuple(MFCEntry.from_json(e) for e in data["mfcs"]),
                               "steps": tuple(Step.from_json(s) for s in data["steps"])})

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
