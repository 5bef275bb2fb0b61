"""The steps of an iteration, one frozen dataclass per kind, and their JSON (the schedule's ``steps``).

Every op names the ``ranks`` that take part; a rank performs the ops it is part of, in list
order (``program.py``). Consumers dispatch with ``match`` over the classes and end in
``typing.assert_never``, so a kind added to ``Op`` is flagged wherever it must be handled;
``op_to_json`` / ``op_from_json`` are the one place an op's JSON is written and read, from the
dataclass fields (``ranks`` first), so a new kind needs no JSON code. Each class's ``kind`` is the
string the schedule file stores.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar, assert_never, get_args

from restage.errors import ConfigError
from restage.layout import Layout


@dataclass(frozen=True)
class Run:
    """Run MFC ``mfc`` (of ``model``) on ``layout``."""

    kind: ClassVar[str] = "run"
    ranks: tuple[int, ...]
    mfc: str
    model: str
    layout: Layout


@dataclass(frozen=True)
class Realloc:
    """Copy ``model``'s parameters from its home ``src`` into layout ``dst`` (a copy the ranks of ``dst`` hold)."""

    kind: ClassVar[str] = "realloc"
    ranks: tuple[int, ...]
    model: str
    src: Layout
    dst: Layout


@dataclass(frozen=True)
class SendKey:
    """Send data key ``key`` of ``producer``'s output from ``producer``'s layout ``src`` to MFC ``mfc`` in ``dst``."""

    kind: ClassVar[str] = "transfer"
    ranks: tuple[int, ...]
    mfc: str
    key: str
    producer: str
    src: Layout
    dst: Layout


@dataclass(frozen=True)
class Free:
    """Drop ``model``'s copy in ``layout`` (it goes stale, or is not needed again this iteration)."""

    kind: ClassVar[str] = "free"
    ranks: tuple[int, ...]
    model: str
    layout: Layout


@dataclass(frozen=True)
class Offload:
    """Move frozen ``model``'s home shard (in ``layout``) to host memory until its next MFC."""

    kind: ClassVar[str] = "offload"
    ranks: tuple[int, ...]
    model: str
    layout: Layout


@dataclass(frozen=True)
class Reload:
    """Bring offloaded ``model``'s home shard (in ``layout``) back to the device."""

    kind: ClassVar[str] = "reload"
    ranks: tuple[int, ...]
    model: str
    layout: Layout


@dataclass(frozen=True)
class Ema:
    """After train MFC ``mfc``: its trained model, reallocated from its home ``src`` into ``model``'s home ``dst``,
    is mixed into ``model`` (``model <- (1 - eta) model + eta trained``)."""

    kind: ClassVar[str] = "ema"
    ranks: tuple[int, ...]
    mfc: str
    model: str
    src: Layout
    dst: Layout


@dataclass(frozen=True)
class Push:
    """Async mode: at the start of every step ``s`` with ``s % every == 0`` (and the first step a rank runs), the
    trained ``model``'s weights go from its home ``src`` into its generation copy in ``dst``, which keeps them
    (and their policy version, ``s``) until the next push."""

    kind: ClassVar[str] = "push"
    ranks: tuple[int, ...]
    model: str
    src: Layout
    dst: Layout
    every: int


@dataclass(frozen=True)
class Generate:
    """Async mode: generate MFC ``mfc`` answers the prompts of each step ``t`` in ``s + start .. s + stop - 1`` (below
    ``run.steps``) whose batch the rollout buffer lacks, with the weights its copy holds, and buffers them.

    ``partial`` (partial rollouts; ``stop = start + 1``): the answers of step ``t = s + start`` the previous step
    left unfinished continue, and step ``t + 1``'s start in the slots ``t``'s free; when all of ``t``'s are done,
    ``t`` is buffered and ``t + 1``'s answers so far stay on the rank, to continue at the next step."""

    kind: ClassVar[str] = "generate"
    ranks: tuple[int, ...]
    mfc: str
    model: str
    layout: Layout
    start: int
    stop: int
    partial: bool = False


@dataclass(frozen=True)
class TakeBuffered:
    """Async mode: the rollout buffer's batch of this step becomes ``mfc``'s output (its transfers read it)."""

    kind: ClassVar[str] = "take"
    ranks: tuple[int, ...]
    mfc: str
    layout: Layout


Op = Run | Realloc | SendKey | Free | Offload | Reload | Ema | Push | Generate | TakeBuffered

# Ops whose ranks wait for their peers (a collective or point-to-point exchange), bounded at run time.
WITH_PEERS: tuple[type, ...] = (Realloc, SendKey, Ema, Push)


# The single-layout kinds store their layout under "dst", as schedule format 1 always has.
_JSON_KEY = {"layout": "dst"}


def op_to_json(op: Op) -> dict[str, Any]:
    """The op as the schedule file stores it: ``kind``, ``ranks``, then its fields in order (layouts as JSON); a
    field with a default is written only when it differs (files written before it existed lack it)."""
    out: dict[str, Any] = {"kind": op.kind, "ranks": list(op.ranks)}
    for f in fields(op)[1:]:
        value = getattr(op, f.name)
        if f.default is not MISSING and value == f.default:
            continue
        out[_JSON_KEY.get(f.name, f.name)] = value.to_json() if isinstance(value, Layout) else value
    return out


_KINDS: dict[str, type[Op]] = {cls.kind: cls for cls in get_args(Op)}


def op_from_json(data: dict[str, Any]) -> Op:
    """The op ``op_to_json`` wrote; ConfigError (one line) for a kind this version does not know."""
    cls = _KINDS.get(data.get("kind", ""))
    if cls is None:
        raise ConfigError(f"schedule step of unknown kind {data.get('kind')!r}; run `restage plan` again with this "
                          "version of restage")
    values: dict[str, Any] = {"ranks": tuple(data["ranks"])}
    for f in fields(cls)[1:]:
        key = _JSON_KEY.get(f.name, f.name)
        if key not in data and f.default is not MISSING:
            continue
        value = data[key]
        values[f.name] = Layout.from_json(value) if f.type == "Layout" else value
    return cls(**values)


def op_subject(op: Op) -> str:
    """What an op serves, for names and messages: the MFC of a run, transfer or EMA, else the model."""
    match op:
        case Run(mfc=name) | SendKey(mfc=name) | Ema(mfc=name) | Generate(mfc=name) | TakeBuffered(mfc=name):
            return name
        case Realloc(model=name) | Free(model=name) | Offload(model=name) | Reload(model=name) | Push(model=name):
            return name
        case _:
            assert_never(op)
