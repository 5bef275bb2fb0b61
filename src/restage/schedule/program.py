"""The per-iteration program every rank walks: runs, reallocations, key transfers, frees, offloads (``ops.py``).

Derived deterministically from the MFCs (in graph order) and their layouts, so every rank
computes the same list. Each op involves a known set of ranks; a rank performs the ops it is
part of, in list order. Since all ranks follow one total order, every pair of ranks meets its
collectives in the same order and the static program cannot deadlock.

Where a model lives: a trainable model's *home* is its train MFC's layout (the DeepSpeed
engine, never freed); a frozen model's home is the layout of its first MFC. Any other layout
gets a copy by reallocation from home before the MFC that needs it. Copies of a trainable
model go stale at its train step, so they are freed after their last use in the iteration;
copies of frozen models are kept. A LoRA model's copies keep their frozen base between steps
(``resident``): they are never freed, and the runtime's later reallocations into them move only
the adapters (``runtime/store/model_store.py``).

A reference EMA (a train MFC whose ``options.ref_ema`` has ``eta`` > 0 and a ``model``)
adds an ``ema`` op right after that train step: the trained model is reallocated from its home
into the reference's home layout and mixed in, ``ref <- (1 - eta) ref + eta actor``. The
reference then changes every iteration, so its copies in other layouts are freed like a
trained model's.
"""

from __future__ import annotations

from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.sharding import param_specs
from restage.schedule.ops import Ema, Free, Offload, Op, Realloc, Reload, Run, SendKey


def model_homes(graph: DataflowGraph, layouts: dict[str, Layout]) -> dict[str, Layout]:
    """The layout that holds each model's master copy."""
    homes: dict[str, Layout] = {}
    for mfc in graph:
        if mfc.kind is MFCKind.TRAIN_STEP:
            homes[mfc.model] = layouts[mfc.name]
    for mfc in graph:
        homes.setdefault(mfc.model, layouts[mfc.name])
    return homes


def ema_targets(graph: DataflowGraph) -> dict[str, str]:
    """Model updated by a reference EMA -> the train MFC whose model is mixed into it."""
    out = {}
    for mfc in graph:
        ema = mfc.options.ref_ema
        if mfc.kind is MFCKind.TRAIN_STEP and ema is not None and ema.eta > 0:
            target = ema.model
            if not any(m.model == target for m in graph):
                raise ConfigError(f"{mfc.name}: the reference EMA updates {target!r}, which no MFC uses")
            out[target] = mfc.name
    return out


def check_ema_architectures(graph: DataflowGraph, archs: dict[str, ModelConfig]) -> None:
    """ConfigError unless every EMA target has the parameters of the model mixed into it (``archs``: name -> ModelConfig)."""
    for target, mfc in ema_targets(graph).items():
        trained = graph[mfc].model
        if param_specs(archs[trained]) != param_specs(archs[target]):
            raise ConfigError(f"algo.ref_ema_eta: models.{target} must have the architecture of models.{trained} to be "
                              "mixed with it; start both from the same base model or set algo.ref_ema_eta=0")


def union_ranks(*layouts: Layout) -> tuple[int, ...]:
    """The ranks of every layout given, sorted."""
    return tuple(sorted({r for layout in layouts for r in layout.mesh}))


def build_program(graph: DataflowGraph, layouts: dict[str, Layout], offload_idle: frozenset[str] = frozenset(),
                  resident: frozenset[str] = frozenset()) -> list[Op]:
    """The ops of one iteration, in the order every rank walks them.

    ``offload_idle``: frozen models to move to CPU memory between their MFCs. ``resident``: trained models
    whose copies stay (LoRA models: the base does not change, only the adapters are moved again).
    """
    return walk(graph, list(graph), layouts, offload_idle, resident)


def build_eval_program(graph: DataflowGraph, layouts: dict[str, Layout], names: tuple[str, ...],
                       offload_idle: frozenset[str] = frozenset(), resident: frozenset[str] = frozenset()) -> list[Op]:
    """The ops of one evaluation pass (runtime/step/evaluation.py): only the MFCs ``names`` (the actor's generation, and
    the reward model's inference when the reward is a model), each in its iteration layout.

    Homes are the whole graph's, so a trained model's copy is reallocated from its training layout
    and freed after its last use here, as in the iteration; data transfers carry what the named
    MFCs read from each other.
    """
    return walk(graph, [graph[name] for name in names], layouts, offload_idle, resident)


def walk(graph: DataflowGraph, mfcs: list[MFC], layouts: dict[str, Layout], offload_idle: frozenset[str],
          resident: frozenset[str] = frozenset()) -> list[Op]:
    """The ops running ``mfcs`` (all of ``graph``'s, or some in graph order) where ``layouts`` put them."""
    homes = model_homes(graph, layouts)
    ema = ema_targets(graph)
    changing = set(graph.trained_models()) | set(ema)
    homes = {model: home for model, home in homes.items() if any(m.model == model for m in mfcs)}
    last_use: dict[tuple[str, Layout], int] = {}
    for i, mfc in enumerate(mfcs):
        last_use[(mfc.model, layouts[mfc.name])] = i
    first_mfc = {m: next(i for i, x in enumerate(mfcs) if x.model == m) for m in homes}
    last_mfc = {m: max(i for i, x in enumerate(mfcs) if x.model == m) for m in homes}
    copies: set[tuple[str, Layout]] = set()
    ops: list[Op] = []
    for i, mfc in enumerate(mfcs):
        layout, home = layouts[mfc.name], homes[mfc.model]
        if mfc.model in offload_idle and i == first_mfc[mfc.model]:
            ops.append(Reload(home.mesh, mfc.model, home))
        if layout != home and (mfc.model, layout) not in copies:
            ops.append(Realloc(union_ranks(home, layout), mfc.model, home, layout))
            copies.add((mfc.model, layout))
        for key in mfc.inputs:
            producer = graph.producer(key)
            if producer is not None and producer in mfcs:
                src = layouts[producer.name]
                ops.append(SendKey(union_ranks(src, layout), mfc.name, key, producer.name, src, layout))
        ops.append(Run(layout.mesh, mfc.name, mfc.model, layout))
        for target, train_mfc in ema.items():
            if train_mfc == mfc.name:
                ops.append(Ema(union_ranks(home, homes[target]), mfc.name, target, home, homes[target]))
        if mfc.kind is MFCKind.TRAIN_STEP:  # copies made before now hold old weights: an MFC after this one gets a new copy
            updated = {mfc.model} | {t for t, m in ema.items() if m == mfc.name}
            copies = {(m, lay) for m, lay in copies if m not in updated}
        if layout != home and mfc.model in changing - resident and last_use[(mfc.model, layout)] == i:
            ops.append(Free(layout.mesh, mfc.model, layout))
            copies.discard((mfc.model, layout))
        if mfc.model in offload_idle and i == last_mfc[mfc.model]:
            ops.append(Offload(home.mesh, mfc.model, home))
    return ops
