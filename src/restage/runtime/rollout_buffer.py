"""Async mode's rollout buffer on a generating rank: generated batches waiting for the step that trains on them.

``schedule/async_program.py`` says when batches enter (``generate`` ops) and leave (``take`` ops); the buffer
holds, per generate MFC and step, this rank's part of the output (with function rewards still being scored), and
the policy version of the weights that generated it. Its depth is bounded by the program: at most
``staleness - push_every + 1`` steps ahead. A checkpoint saves it whole (rewards settled), so a resumed run trains
on the very batches an uninterrupted one would (docs/runtime.md, "Asynchronous training").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from restage.algorithms.base import PendingRewards
from restage.data.batch import Batch


@dataclass
class Buffered:
    """One generate MFC's output for one step, on this rank."""

    batch: Batch
    version: int  # the policy version that generated it
    pending: PendingRewards | None = None  # function rewards still being scored


class RolloutBuffer:
    """(generate MFC, step) -> this rank's part of that step's generated batch."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], Buffered] = {}

    def holds(self, mfc: str, step: int) -> bool:
        return (mfc, step) in self.entries

    def put(self, mfc: str, step: int, entry: Buffered) -> None:
        assert (mfc, step) not in self.entries, f"{mfc}: step {step + 1}'s batch generated twice"
        self.entries[(mfc, step)] = entry

    def take(self, mfc: str, step: int) -> Buffered:
        entry = self.entries.pop((mfc, step), None)
        if entry is None:
            raise RuntimeError(f"{mfc}: the rollout buffer holds no batch for step {step + 1} (it holds "
                               f"{sorted(s + 1 for m, s in self.entries if m == mfc)}); the async program is wrong")
        return entry

    def occupancy(self, mfc: str) -> int:
        """Batches of ``mfc`` waiting (generated, not yet trained on)."""
        return sum(1 for m, _ in self.entries if m == mfc)

    def state_dict(self) -> dict[str, Any]:
        """Plain tensors, lists and numbers (``torch.load(weights_only=True)`` reads them); rewards are waited for."""
        out = []
        for (mfc, step), entry in sorted(self.entries.items()):
            batch = entry.pending.attach(entry.batch) if entry.pending is not None else entry.batch
            entry.batch, entry.pending = batch, None
            out.append({"mfc": mfc, "step": step, "version": entry.version, "seqlens": list(batch.seqlens),
                        "tokens": dict(batch.tokens), "seqs": dict(batch.seqs), "group_size": batch.group_size,
                        "ids": list(batch.ids)})
        return {"entries": out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = {}
        for item in state["entries"]:
            batch = Batch(tuple(item["seqlens"]), {k: torch.as_tensor(v) for k, v in item["tokens"].items()},
                          {k: torch.as_tensor(v) for k, v in item["seqs"].items()}, int(item["group_size"]),
                          tuple(item["ids"]))
            self.entries[(item["mfc"], int(item["step"]))] = Buffered(batch, int(item["version"]))
