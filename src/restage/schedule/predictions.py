"""What the planner predicted and how it chose: typed fields of the schedule (``Schedule.predicted``, ``.plan``,
``MFCEntry.predicted``, ``Step.predicted``). Their JSON keeps the names the reports read (``report/throughput.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

PlanMethod = Literal["search", "heuristic", "manual", "async-split"]  # how the layouts were chosen
ModeName = Literal["sync", "async"]


@dataclass(frozen=True)
class SpanPrediction:
    """A step's predicted span on the iteration's timeline."""

    seconds: float
    start_seconds: float
    end_seconds: float

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SpanPrediction:
        return cls(data["seconds"], data["start_seconds"], data["end_seconds"])


@dataclass(frozen=True)
class MFCPrediction:
    """One MFC's estimate: its span, the peak memory of its ranks, the estimator that made it and its parts."""

    seconds: float
    peak_memory_bytes: int
    start_seconds: float
    end_seconds: float
    source: str
    breakdown: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MFCPrediction:
        return cls(data["seconds"], data["peak_memory_bytes"], data["start_seconds"], data["end_seconds"],
                   data["source"], dict(data["breakdown"]))


@dataclass(frozen=True)
class IterationPrediction:
    """The whole iteration's estimate."""

    iteration_seconds: float
    samples_per_iteration: int
    samples_per_second: float
    flops_per_iteration: float
    pflops_per_second: float
    peak_memory_bytes: int
    usable_memory_bytes: int
    estimator: tuple[str, ...]  # the estimates' sources
    iteration_overlap: bool

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"estimator": list(self.estimator)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IterationPrediction:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        return cls(**values | {"estimator": tuple(data["estimator"])})


@dataclass(frozen=True)
class BaselinePrediction:
    """A peer system's default plan (or a restricted search), scored by restage's estimator."""

    iteration_seconds: float
    peak_memory_bytes: int


@dataclass(frozen=True)
class ModeChoice:
    """What ``plan.execution: auto`` compared: the synchronous plan's and the best asynchronous plan's predicted
    samples/s, and the mode chosen (the faster; sync on a tie)."""

    chosen: ModeName
    sync_samples_per_second: float | None
    async_samples_per_second: float | None
    staleness: int  # of the best async plan (0: none found)
    push_every: int
    partial: bool = False  # the best async plan uses partial rollouts

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "sync_samples_per_second": self.sync_samples_per_second,
                "async_samples_per_second": self.async_samples_per_second, "staleness": self.staleness,
                "push_every": self.push_every, "partial_rollouts": self.partial}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModeChoice:
        return cls(data["chosen"], data["sync_samples_per_second"], data["async_samples_per_second"],
                   data["staleness"], data["push_every"], bool(data.get("partial_rollouts", False)))


@dataclass(frozen=True)
class SearchFacts:
    """How the search went: its method, steps, wall time, why it stopped and the best few plans' iteration seconds."""

    method: str
    steps: int
    wall_seconds: float
    stopped_by: str
    top_iteration_seconds: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"top_iteration_seconds": list(self.top_iteration_seconds)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SearchFacts:
        return cls(data["method"], data["steps"], data["wall_seconds"], data["stopped_by"],
                   tuple(data["top_iteration_seconds"]))


@dataclass(frozen=True)
class PlanFacts:
    """How the plan was chosen: the method, the seed, the baselines compared, the modes compared (``plan.execution:
    auto``) and the search's statistics (a search)."""

    mode: PlanMethod
    seed: int
    baselines: dict[str, BaselinePrediction | None]
    mode_choice: ModeChoice | None = None
    search: SearchFacts | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "seed": self.seed,
                               "baselines": {name: (None if b is None else dataclasses.asdict(b))
                                             for name, b in self.baselines.items()}}
        if self.mode_choice is not None:
            out["execution"] = self.mode_choice.to_json()
        if self.search is not None:
            out["search"] = self.search.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanFacts:
        baselines = {name: (None if b is None else BaselinePrediction(b["iteration_seconds"], b["peak_memory_bytes"]))
                     for name, b in data["baselines"].items()}
        choice = ModeChoice.from_json(data["execution"]) if "execution" in data else None
        search = SearchFacts.from_json(data["search"]) if "search" in data else None
        return cls(data["mode"], data["seed"], baselines, choice, search)
