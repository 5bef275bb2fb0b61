"""Async mode's rollout buffer on a generating rank: generated batches waiting for the step that trains on them.

``schedule/async_program.py`` says when batches enter (``generate`` ops) and leave (``take`` ops); the buffer
holds, per generate MFC and step, this rank's part of the output (with function rewards still being scored), and
the policy version of the weights that generated it. Its depth is bounded by the program: at most
``staleness - push_every + 1`` steps ahead. A checkpoint saves it whole (rewards settled), so a resumed run trains
on the very batches an uninterrupted one would (docs/runtime.md, "Asynchronous training").

With partial rollouts it also holds the batch begun behind the last one finished (each request's ``Answer`` so
far: its tokens, their log-probs and versions), saved and restored with the rest; multi-turn episodes begun
(``partial_episodes.EpisodesInFlight``, live environments) are not saved: a resumed run starts them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from restage.algorithms.base import PendingRewards
from restage.data.batch import Batch
from restage.runtime.step.partial_episodes import EpisodesInFlight


@dataclass
class Buffered:
    """One generate MFC's output for one step, on this rank."""

    batch: Batch
    version: int  # the policy version that generated it
    pending: PendingRewards | None = None  # function rewards still being scored


@dataclass(frozen=True)
class Answer:
    """One request's answer so far (partial rollouts): its tokens, their log-probs and versions, and whether it is
    done (EOS or max_new_tokens)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    finished: bool = False


Begun = tuple[Answer, ...] | EpisodesInFlight  # a batch begun by partial rollouts: answers, or live episodes


class RolloutBuffer:
    """(generate MFC, step) -> this rank's part of that step's generated batch; and the batches still in flight."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, int], Buffered] = {}
        self.in_flight: dict[tuple[str, int], Begun] = {}  # partial rollouts: answers (or episodes) so far

    def keep_in_flight(self, mfc: str, step: int, answers: Begun) -> None:
        assert (mfc, step) not in self.in_flight, f"{mfc}: step {step + 1}'s batch begun twice"
        self.in_flight[(mfc, step)] = answers

    def resume_in_flight(self, mfc: str, step: int) -> Begun | None:
        """The answers of step ``step``'s batch begun earlier (None: not begun); they leave the buffer."""
        return self.in_flight.pop((mfc, step), None)

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
        flight = [{"mfc": mfc, "step": step, "tokens": [list(a.tokens) for a in answers],
                   "logprobs": [list(a.logprobs) for a in answers], "versions": [list(a.versions) for a in answers],
                   "finished": [a.finished for a in answers]}
                  for (mfc, step), answers in sorted(self.in_flight.items()) if isinstance(answers, tuple)]
        return {"entries": out, "in_flight": flight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.in_flight = {
            (item["mfc"], int(item["step"])): tuple(
                Answer(tuple(int(t) for t in tokens), tuple(float(x) for x in logprobs), tuple(int(v) for v in versions),
                       bool(finished))
                for tokens, logprobs, versions, finished in zip(item["tokens"], item["logprobs"], item["versions"],
                                                                item["finished"], strict=True))
            for item in state.get("in_flight", [])}
        self.entries = {}
        for item in state["entries"]:
            batch = Batch(tuple(item["seqlens"]), {k: torch.as_tensor(v) for k, v in item["tokens"].items()},
                          {k: torch.as_tensor(v) for k, v in item["seqs"].items()}, int(item["group_size"]),
                          tuple(item["ids"]))
            self.entries[(item["mfc"], int(item["step"]))] = Buffered(batch, int(item["version"]))
