"""Model function calls (MFCs) and the dataflow graph they form.

An MFC is one ``generate``, ``inference`` or ``train_step`` of one model, with input and
output keys. Edges come from the keys: an MFC depends on the MFC that produces each of its
inputs; keys nobody produces come from the dataset. Each algorithm declares its MFCs in
``restage/algorithms/<name>.py`` (function ``mfcs(cfg)``); ``restage.algorithms.interface.build_graph``
assembles them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from restage.errors import ConfigError


class MFCKind(StrEnum):
    """What an MFC does with its model. A ``StrEnum`` so the schedule's JSON and logs keep the plain names;
    code dispatches on the members with ``match`` (never on the strings)."""

    GENERATE = "generate"
    INFERENCE = "inference"
    TRAIN_STEP = "train_step"


MFC_KINDS = tuple(k.value for k in MFCKind)


@dataclass(frozen=True)
class MFC:
    """One model function call and the workload it carries per iteration.

    ``n_seqs`` sequences go through it per iteration; each has ``prompt_tokens`` prompt tokens
    and ``gen_tokens`` answer tokens (generated for ``generate``, given otherwise).
    ``train_step`` makes ``epochs`` passes over its batch in ``minibatches`` optimizer steps each.
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
    options: dict = field(default_factory=dict, compare=False, hash=False)

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
            "epochs": self.epochs, "greedy": self.greedy, "options": dict(self.options),
        }

    @classmethod
    def from_json(cls, data: dict) -> MFC:
        data = dict(data)
        data["inputs"], data["outputs"] = tuple(data["inputs"]), tuple(data["outputs"])
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
        return tuple(dict.fromkeys(m.model for m in self.mfcs if m.kind == "train_step"))

    def to_json(self) -> list[dict]:
        return [m.to_json() for m in self.mfcs]

    @classmethod
    def from_json(cls, data: list[dict]) -> DataflowGraph:
        return cls(tuple(MFC.from_json(d) for d in data))
