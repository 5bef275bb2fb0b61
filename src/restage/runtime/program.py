"""The per-iteration program every rank walks: runs, reallocations, transfers, frees, offloads.

Derived deterministically from the MFCs (in graph order) and their layouts, so every rank
computes the same list. Each op involves a known set of ranks; a rank performs the ops it is
part of, in list order. Since all ranks follow one total order, every pair of ranks meets its
collectives in the same order and the static program cannot deadlock.

Where a model lives: a trainable model's *home* is its train MFC's layout (the DeepSpeed
engine, never freed); a frozen model's home is the layout of its first MFC. Any other layout
gets a copy by reallocation from home before the MFC that needs it. Copies of a trainable
model go stale at its train step, so they are freed after their last use in the iteration;
copies of frozen models are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from restage.graph import DataflowGraph
from restage.layout import Layout


@dataclass(frozen=True)
class Op:
    """``kind`` is run | realloc | transfer | free | offload | reload."""

    kind: str
    ranks: tuple[int, ...]
    mfc: str = ""
    model: str = ""
    key: str = ""
    producer: str = ""
    src: Layout | None = None
    dst: Layout | None = None

    def to_json(self) -> dict:
        out = {"kind": self.kind, "ranks": list(self.ranks)}
        for name in ("mfc", "model", "key", "producer"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        for name in ("src", "dst"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name).to_json()
        return out


def model_homes(graph: DataflowGraph, layouts: dict[str, Layout]) -> dict[str, Layout]:
    """The layout that holds each model's master copy."""
    homes: dict[str, Layout] = {}
    for mfc in graph:
        if mfc.kind == "train_step":
            homes[mfc.model] = layouts[mfc.name]
    for mfc in graph:
        homes.setdefault(mfc.model, layouts[mfc.name])
    return homes


def _union(*layouts: Layout) -> tuple[int, ...]:
    return tuple(sorted({r for layout in layouts for r in layout.mesh}))


def build_program(graph: DataflowGraph, layouts: dict[str, Layout], offload_idle: frozenset[str] = frozenset()
                  ) -> list[Op]:
    """The ops of one iteration, in the order every rank walks them.

    ``offload_idle``: frozen models to move to CPU memory between their MFCs.
    """
    homes = model_homes(graph, layouts)
    trained = set(graph.trained_models())
    mfcs = list(graph)
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
            ops.append(Op("reload", home.mesh, model=mfc.model, dst=home))
        if layout != home and (mfc.model, layout) not in copies:
            ops.append(Op("realloc", _union(home, layout), model=mfc.model, src=home, dst=layout))
            copies.add((mfc.model, layout))
        for key in mfc.inputs:
            producer = graph.producer(key)
            if producer is not None:
                src = layouts[producer.name]
                ops.append(Op("transfer", _union(src, layout), mfc=mfc.name, key=key, producer=producer.name,
                              src=src, dst=layout))
        ops.append(Op("run", layout.mesh, mfc=mfc.name, model=mfc.model, dst=layout))
        if layout != home and mfc.model in trained and last_use[(mfc.model, layout)] == i:
            ops.append(Op("free", layout.mesh, model=mfc.model, dst=layout))
            copies.discard((mfc.model, layout))
        if mfc.model in offload_idle and i == last_mfc[mfc.model]:
            ops.append(Op("offload", home.mesh, model=mfc.model, dst=home))
    return ops
