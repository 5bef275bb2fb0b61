"""The rounds of a reallocation in flight on one rank: each posted as one ``batch_isend_irecv``, the sides that
pack or unpack taking room in one circular bucket (``realloc.execute_reallocation`` drives it; docs/realloc.md)."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias

import torch
import torch.distributed as dist

from restage.schedule.realloc_plan import Piece
from restage.schedule.realloc_rounds import Message, Round

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

# A round in flight: its works, the payloads to unpack, and (start, stop) of its room in the ring (None: in place).
_InFlight: TypeAlias = "tuple[list[dist.Work], list[tuple[Message, torch.Tensor]], tuple[int, int] | None]"


def piece_view(tensor: torch.Tensor, dim: int, rng: tuple[int, int]) -> torch.Tensor:
    """The slice ``rng`` of ``tensor`` along ``dim``: a piece's place in a source or destination tensor."""
    return tensor.detach().narrow(dim, rng[0], rng[1] - rng[0])


@dataclass
class Tally:
    """Bytes of the buffers this rank really handed to torch.distributed, per (sender, receiver) link."""

    sent: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))
    received: dict[tuple[int, int], int] = field(default_factory=lambda: defaultdict(int))


class Batches:
    """Posts rounds as batches; the sides that pack or unpack take room in one circular buffer.

    A side in place (the piece's own memory, contiguous) needs no room, so a round in place on
    this rank is posted at once and waited on only at the end (or before a gathered unit is
    released). A round that packs takes the next room of its size after the newest packing round
    in flight (wrapping around), finishing (and unpacking) the oldest packing rounds until it
    fits, so every round that fits is in flight at once and together they never exceed the
    buffer. While it waits, the rank makes its local copies. Every rank posts the same rounds in
    the same order and waits only on rounds it has posted: the lowest unfinished round has every
    member posted (a member waits only on lower rounds, all finished), so nothing deadlocks.
    """

    def __init__(self, buffer: torch.Tensor | None, me: int, src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
                 group: ProcessGroup | None, tally: Tally) -> None:
        self.buffer = buffer
        self.pending: deque[_InFlight] = deque()  # in flight, oldest first
        self.local: deque[Piece] = deque()  # local copies still to make
        self.me, self.src, self.dst, self.group, self.tally = me, src, dst, group, tally

    def post(self, r: Round) -> None:
        me = self.me
        numel = r.packed_numel(me)
        start = self._room(numel) if numel else 0
        room = (start, start + numel) if numel else None
        ops: list[dist.P2POp] = []
        unpack: list[tuple[Message, torch.Tensor]] = []
        for t in r.messages:
            sender = t.src_rank == me
            if not sender and me not in t.dst_ranks:
                continue
            if t.in_place_for(me):
                (p,) = t.pieces
                payload = (piece_view(self.src[p.name], p.dim, p.src_range) if sender
                           else piece_view(self.dst[p.name], p.dim, p.dst_range))
            else:
                assert self.buffer is not None  # a round that packs here counted in the ring's size, so there is one
                payload = self.buffer[start: start + t.numel]
                start += t.numel
                if sender:
                    offset = 0
                    for p in t.pieces:
                        payload[offset: offset + p.numel].view(p.block_shape).copy_(
                            piece_view(self.src[p.name], p.dim, p.src_range))
                        offset += p.numel
                else:
                    unpack.append((t, payload))
            nbytes = payload.numel() * payload.element_size()
            if sender:  # one send per receiver, from the same memory
                for dst in t.dst_ranks:
                    ops.append(dist.P2POp(dist.isend, payload, dst, self.group))
                    self.tally.sent[(me, dst)] += nbytes
            else:
                ops.append(dist.P2POp(dist.irecv, payload, t.src_rank, self.group))
                self.tally.received[(t.src_rank, me)] += nbytes
        if ops:
            self.pending.append((dist.batch_isend_irecv(ops), unpack, room))

    def _room(self, numel: int) -> int:
        """Where ``numel`` elements fit after the newest packing round in flight, finishing the oldest until they do."""
        assert self.buffer is not None  # asked only for a round that packs, which the ring was sized for
        size = self.buffer.numel()
        while True:
            rooms = [room for _, _, room in self.pending if room is not None]
            if not rooms:
                return 0
            head, tail = rooms[-1][1], rooms[0][0]
            if head > tail:  # not wrapped: room after the head, or at the start before the tail
                if head + numel <= size:
                    return head
                if numel <= tail:
                    return 0
            elif head + numel <= tail:
                return head
            self._finish(next(entry for entry in self.pending if entry[2] is not None))

    def _finish(self, entry: _InFlight) -> None:
        del self.pending[next(i for i, e in enumerate(self.pending) if e is entry)]  # by identity: entries hold tensors
        works, unpack, _ = entry
        for work in works:
            while self.local and not work.is_completed():
                self._copy_one_local()
            work.wait()
        for t, payload in unpack:
            offset = 0
            for p in t.pieces:
                piece_view(self.dst[p.name], p.dim, p.dst_range).copy_(payload[offset: offset + p.numel].view(p.block_shape))
                offset += p.numel

    def _copy_one_local(self) -> None:
        p = self.local.popleft()
        piece_view(self.dst[p.name], p.dim, p.dst_range).copy_(piece_view(self.src[p.name], p.dim, p.src_range))

    def drain(self) -> None:
        """Make the remaining local copies and finish every round in flight (unpacking what arrived)."""
        while self.local:
            self._copy_one_local()
        while self.pending:
            self._finish(self.pending[0])
