"""Model function calls (MFCs) and the dataflow graph they form.

An MFC is one ``generate``, ``inference`` or ``train_step`` of one model, with input and
output keys. Edges come from the keys: an MFC depends on the MFC that produces each of its
inputs; keys nobody produces come from the dataset. Each algorithm declares its MFCs in
``restage/algorithms/<name>.py`` (function ``mfcs(cfg)``); ``restage.algorithms.interface.build_graph``
assembles them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from restage.errors import ConfigError


class MFCKind(StrEnum):
    """What an MFC does with its model. A ``StrEnum`` so the schedule's JSON and logs keep the plain names;
    code dispatches on the members with ``match`` (never on the strings)."""

    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"


MFC_KINDS = tuple(k.value for k in MFCKind)


@dataclass(frozen=True)
class Episodes:
    """A multi-turn generate MFC's figures for the estimator (``algorithms/episode_sizes.py``): answers per episode,
    observation tokens prefilled (not decoded) per episode, and one tool call's wall time."""

    turns: int
    observation_tokens: int
    tool_seconds: float


@dataclass(frozen=True)
class RefEMA:
    """A train MFC's reference EMA: after each step ``model``'s weights move ``eta`` of the way to the trained ones
    (``schedule.program``'s ``ema`` op)."""

    eta: float
    model: str = "ref"


@dataclass(frozen=True)
class MFCOptions:
    """What an algorithm tells the planner and the runtime about one MFC beyond its sizes. Each is None when not set,
    and then absent from the schedule file, so a file keeps exactly the keys its algorithm wrote."""

    group_size: int | None = None  # generate: answers per prompt (GRPO, RAFT); None: one
    dynamic_sampling_rounds: int | None = None  # generate: DAPO's extra rounds for all-equal groups (dynamic_sampling)
    episodes: Episodes | None = None  # generate: multi-turn episodes
    ref_ema: RefEMA | None = None  # train_step: the reference EMA applied after it

    @property
    def group(self) -> int:
        """Answers per prompt (1 when the MFC has no groups)."""
        return 1 if self.group_size is None else self.group_size

    def to_json(self) -> dict[str, int | float | str]:
        """The schedule file's ``options``: the flat keys algorithms wrote before these were typed, in that order."""
        out: dict[str, int | float | str] = {}
        if self.group_size is not None:
            out["group_size"] = self.group_size
        if self.dynamic_sampling_rounds is not None:
            out["dynamic_sampling_rounds"] = self.dynamic_sampling_rounds
        if self.episodes is not None:
            out |= {"turns": self.episodes.turns, "observation_tokens": self.episodes.observation_tokens,
                    "tool_seconds": self.episodes.tool_seconds}
        if self.ref_ema is not None:
            out |= {"ref_ema_eta": self.ref_ema.eta, "ref_ema_model": self.ref_ema.model}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "MFC") -> MFCOptions:
        unknown = sorted(set(data) - _OPTION_KEYS)
        if unknown:
            raise ConfigError(f"{where}: unknown options {', '.join(unknown)}; known: {', '.join(sorted(_OPTION_KEYS))}"
                              "; run `restage plan` again with this version")
        episodes = (Episodes(int(data["turns"]), int(data["observation_tokens"]), float(data["tool_seconds"]))
                    if "turns" in data else None)
        ref_ema = (RefEMA(float(data["ref_ema_eta"]), str(data.get("ref_ema_model", "ref")))
                   if "ref_ema_eta" in data else None)
        rounds = data.get("dynamic_sampling_rounds")
        return cls(group_size=None if data.get("group_size") is None else int(data["group_size"]),
                   dynamic_sampling_rounds=None if rounds is None else int(rounds), episodes=episodes, ref_ema=ref_ema)


_OPTION_KEYS = frozenset({"group_size", "dynamic_sampling_rounds", "turns", "observation_tokens", "tool_seconds",
                          "ref_ema_eta", "ref_ema_model"})


@dataclass(frozen=True)
class MFC:
    """One model function call and the workload it carries per iteration.

    ``n_seqs`` sequences go through it per iteration; each has ``prompt_tokens`` prompt tokens
    and ``gen_tokens`` answer tokens (generated for ``generate``, given otherwise).
    ``train_step`` makes ``epochs`` passes over its batch in ``minibatches`` optimizer steps each.
    ``options``: what else the algorithm says about it (groups, dynamic sampling, episodes, a reference EMA).
    """

    name: str
    kind: MFCKind
    model: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    n_seqs: int
    prompt_tokens: int
    gen_tokens: int
    micro_batches: int = 1
    minibatches: int = 1
    epochs: int = 1
    greedy: bool = False
    options: MFCOptions = field(default_factory=MFCOptions, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.kind not in MFC_KINDS:
            raise ConfigError(f"MFC {self.name}: kind {self.kind!r} is not one of {', '.join(MFC_KINDS)}")
        object.__setattr__(self, "kind", MFCKind(self.kind))  # a name read from JSON or written by an algorithm

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.gen_tokens

    @property
    def tokens(self) -> int:
        """Tokens per pass over the batch."""
        return self.n_seqs * self.seq_tokens

    def to_json(self) -> dict:
        return {
            "name": self.name, "kind": self.kind.value, "model": self.model, "inputs": list(self.inputs),
            "outputs": list(self.outputs), "n_seqs": self.n_seqs, "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens, "micro_batches": self.micro_batches, "minibatches": self.minibatches,
            "epochs": self.epochs, "greedy": self.greedy, "options": self.options.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict) -> MFC:
        data = dict(data)
        data["inputs"], data["outputs"] = tuple(data["inputs"]), tuple(data["outputs"])
        data["options"] = MFCOptions.from_json(data.get("options", {}), f"MFC {data.get('name')}")
        return cls(**data)


@dataclass(frozen=True)
class DataflowGraph:
    """MFCs in a valid execution order, and the edges implied by their keys."""

    mfcs: tuple[MFC, ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.mfcs]
        if len(set(names)) != len(names):
            raise ConfigError(f"MFC names repeat: {names}")
        producers: dict[str, str] = {}
        for mfc in self.mfcs:
            for key in mfc.outputs:
                if key in producers:
                    raise ConfigError(f"key {key!r} is produced by both {producers[key]} and {mfc.name}")
                producers[key] = mfc.name
        # Order topologically (stable: declaration order breaks ties) and refuse cycles.
        ordered, done = [], set()
        pending = list(self.mfcs)
        while pending:
            ready = [m for m in pending if all(producers.get(k) in done or k not in producers for k in m.inputs)]
            if not ready:
                raise ConfigError(f"the MFCs {[m.name for m in pending]} depend on each other in a cycle")
            ordered.append(ready[0])
            done.add(ready[0].name)
            pending.remove(ready[0])
        object.__setattr__(self, "mfcs", tuple(ordered))

    def __iter__(self):
        return iter(self.mfcs)

    def __getitem__(self, name: str) -> MFC:
        for mfc in self.mfcs:
            if mfc.name == name:
                return mfc
        raise KeyError(name)

    def producer(self, key: str) -> MFC | None:
        for mfc in self.mfcs:
            if key in mfc.outputs:
                return mfc
        return None

    def source_keys(self) -> tuple[str, ...]:
        """Keys read from the dataset (produced by no MFC)."""
        keys = []
        for mfc in self.mfcs:
            keys += [k for k in mfc.inputs if self.producer(k) is None and k not in keys]
        return tuple(keys)

    def parents(self, name: str) -> tuple[MFC, ...]:
        out = []
        for key in self[name].inputs:
            mfc = self.producer(key)
            if mfc is not None and mfc not in out:
                out.append(mfc)
        return tuple(out)

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer MFC, consumer MFC, key) for every key that flows between MFCs."""
        return [(p.name, m.name, k) for m in self.mfcs for k in m.inputs if (p := self.producer(k)) is not None]

    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.model for m in self.mfcs))

    def trained_models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.model for m in self.mfcs if m.kind is MFCKind.TRAIN_STEP))

    def to_json(self) -> list[dict]:
        return [m.to_json() for m in self.mfcs]

    @classmethod
    def from_json(cls, data: list[dict]) -> DataflowGraph:
        return cls(tuple(MFC.from_json(d) for d in data))
