"""The rollout engine's slot table: which request holds each cache slot, and how far it has come.

A slot is a row of the KV cache. The table is host bookkeeping, exact (nothing is read back from the device):
each busy slot has an ``Occupant`` (its request, the tokens its cache row holds, the answer tokens chosen so
far, when it was admitted); a free slot has none. The engine owns the one table and is the only writer; the
pipelined rollout and the multi-turn engine read it through the engine.

A decode step runs over a ``SlotGroup``'s first ``bound`` slots, ``bound`` the group's last busy slot + 1 rounded
up to a power of two (``bucket``), so a CUDA graph per bucket serves every step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from restage.rollout.decode_graphs import stage_inputs


@dataclass(frozen=True)
class SlotGroup:
    """Cache slots ``start .. start + size - 1``, decoded together (all slots, or one pipelined micro-group)."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))


def slot_groups(slots: int, count: int) -> list[SlotGroup]:
    """``slots`` split into ``count`` consecutive groups whose sizes differ by at most one."""
    bounds = [g * slots // count for g in range(count + 1)]
    return [SlotGroup(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


def bucket(n: int, slots: int) -> int:
    """The decode bound for ``n`` slots from a group's first of ``slots``: ``n`` up to a power of 2, at most ``slots``."""
    return 0 if n == 0 else min(slots, 1 << (n - 1).bit_length())


@dataclass(frozen=True)
class Admission:
    """Requests that took free slots: the slots prefilled now (one per new prompt) and the prefix copies."""

    slots: list[int]
    prefixes: list[Sequence[int]]
    copies: dict[tuple[int, int], list[int]]  # (source slot, tokens) -> the target slots that copy them


@dataclass
class Occupant:
    """The request in a busy slot."""

    request: int
    length: int  # tokens in the slot's cache row before this step's input (this step's position)
    step: int  # answer tokens chosen so far (this step's answer position)
    admitted: int  # the table's admission count when it took the slot: preemption takes the newest


class SlotTable:
    """Which request holds each of ``size`` slots (see the module doc); a free slot is ``None``."""

    def __init__(self, size: int):
        self.occupants: list[Occupant | None] = [None] * size
        self.admissions = 0  # requests admitted so far (preemption's order)

    def __len__(self) -> int:
        return len(self.occupants)

    def __getitem__(self, slot: int) -> Occupant | None:
        return self.occupants[slot]

    def request(self, slot: int) -> int | None:
        """The request in ``slot``, None when it is free."""
        occupant = self.occupants[slot]
        return occupant.request if occupant is not None else None

    def busy(self, group: SlotGroup) -> list[int]:
        """``group``'s busy slots, in order."""
        return [i for i in group if self.occupants[i] is not None]

    def free(self, group: SlotGroup) -> list[int]:
        """``group``'s free slots, in order."""
        return [i for i in group if self.occupants[i] is None]

    def any_busy(self, group: SlotGroup) -> bool:
        return any(self.occupants[i] is not None for i in group)

    def any_free(self, group: SlotGroup) -> bool:
        return any(self.occupants[i] is None for i in group)

    def requests(self) -> list[int]:
        """The requests in the slots, in slot order."""
        return [o.request for o in self.occupants if o is not None]

    def bound(self, group: SlotGroup) -> int:
        """Slots a decode step of ``group`` runs over from its first: past its last busy one, to a power of 2."""
        last = max((i for i in group if self.occupants[i] is not None), default=group.start - 1)
        return bucket(last + 1 - group.start, group.size)

    def admit(self, slot: int, request: int, length: int, step: int) -> None:
        """``request`` takes free ``slot`` with ``length`` tokens cached and ``step`` answer tokens chosen."""
        assert self.occupants[slot] is None, f"slot {slot} is busy"
        self.admissions += 1
        self.occupants[slot] = Occupant(request, length, step, self.admissions)

    def vacate(self, slot: int) -> Occupant:
        """``slot``'s request leaves it; returns what it held."""
        occupant = self.occupants[slot]
        assert occupant is not None, f"slot {slot} is free"
        self.occupants[slot] = None
        return occupant

    def move(self, source: int, target: int) -> None:
        """``source``'s request moves to free slot ``target`` (compaction)."""
        assert self.occupants[target] is None, f"slot {target} is busy"
        self.occupants[target], self.occupants[source] = self.occupants[source], None

    def newest(self, slots: range) -> int:
        """The busy slot of ``slots`` admitted last."""
        return max((i for i in slots if self.occupants[i] is not None), key=lambda i: self._occupant(i).admitted)

    def longest(self, lo: int, hi: int) -> int:
        """The most tokens a slot of ``lo .. hi - 1`` holds (a free slot holds none)."""
        return max((o.length for o in self.occupants[lo:hi] if o is not None), default=0)

    def stage_rows(self, lo: int, bound: int, spare_row: int) -> torch.Tensor:
        """``stage_inputs`` of slots ``lo .. lo + bound - 1``: their positions, answer steps and output rows."""
        occupants = self.occupants[lo:lo + bound]
        return stage_inputs([o.length if o is not None else 0 for o in occupants],
                            [o.step if o is not None else 0 for o in occupants],
                            [o.request if o is not None else None for o in occupants], bound, spare_row)

    def advance(self, lo: int, bound: int, max_new: Sequence[int]) -> list[int]:
        """A decode step of slots ``lo .. lo + bound - 1`` wrote one token each; returns the busy slots whose
        request reached its ``max_new`` tokens."""
        done = []
        for i in range(lo, lo + bound):
            occupant = self.occupants[i]
            if occupant is not None:
                occupant.length += 1
                occupant.step += 1
                if occupant.step == max_new[occupant.request]:
                    done.append(i)
        return done

    def _occupant(self, slot: int) -> Occupant:
        occupant = self.occupants[slot]
        assert occupant is not None
        return occupant
