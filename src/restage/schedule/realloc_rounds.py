"""A reallocation plan's pieces as the messages and rounds every rank walks in the same order.

``schedule_messages`` packs the pieces of a ``ReallocPlan`` (``realloc_plan.py``) into bucketed messages per
(sender, receivers) channel; ``schedule_rounds`` cuts them into the batches all ranks post together. Pure
Python, like the planner: the runtime's executor (``runtime/dataplane/realloc.py``) and the tests read both.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property, lru_cache

from restage.errors import PlanError
from restage.schedule.realloc_plan import Piece, ReallocPlan

# A message is at most 1/SLOTS of the bucket, so a round (half a bucket) holds at least SLOTS // 2 of them.
SLOTS = 4


@dataclass(frozen=True)
class Message:
    """One communication: ``pieces`` from ``src_rank`` to ``dst_ranks`` as one message.

    A side ``in place`` reads (sender) or writes (receivers) the piece's own memory; the other
    side of a one-piece message may still go through a bucket (the sender packs a strided
    source block, or the receivers unpack into a strided destination block). ``packed``
    messages use a bucket on at least one side and hold at most the bucket size; a message
    of several pieces is packed on both sides. The sender sends it once to each receiver, in
    one batch (``schedule_rounds``). ``unit`` is the pieces' unit (``Piece.unit``) when gathering unit by unit,
    else 0.
    """

    unit: int
    src_rank: int
    dst_ranks: tuple[int, ...]
    pieces: tuple[Piece, ...]
    send_in_place: bool = False
    receive_in_place: bool = False

    @property
    def packed(self) -> bool:
        return not (self.send_in_place and self.receive_in_place)

    def in_place_for(self, rank: int) -> bool:
        """Whether ``rank`` (the sender or a receiver) hands the piece's own memory to the transport."""
        return self.send_in_place if rank == self.src_rank else self.receive_in_place

    @cached_property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@lru_cache(maxsize=64)  # a run replays the same few plans every iteration
def schedule_messages(plan: ReallocPlan, bucket_bytes: int, direct_min_bytes: int = 1 << 18,
                      by_unit: bool = True) -> tuple[Message, ...]:
    """The plan's pieces as an ordered list of messages, which every rank walks in the same order.

    A piece of at least ``direct_min_bytes`` that is contiguous on one side at least travels
    alone, in place on each side where it is contiguous (the other side packs or unpacks it
    through a bucket, so it must fit one). The rest are packed into buckets of at most
    ``bucket_bytes`` per (sender, receivers) channel, a piece larger than a bucket being cut
    along its axis. ``by_unit`` keeps every message inside one unit (what a ZeRO-3 source
    gathers at a time; the executor always asks for it, so the order never depends on a
    rank's source); without it a bucket spans units. Order: by unit, messages in place on
    both sides first, then the others, each by channel and parameter. All ranks must pass the
    same arguments.
    """
    bpe = plan.bytes_per_element
    if bucket_bytes < bpe:
        raise PlanError(f"bucket of {bucket_bytes} bytes cannot hold one element; use a larger bucket")
    channels: dict[tuple[int, int, tuple[int, ...]], list[Piece]] = defaultdict(list)
    for p in plan.pieces:
        channels[(p.unit if by_unit else 0, p.src_rank, p.dst_ranks)].append(p)
    direct: list[Message] = []
    packed: list[Message] = []
    capacity = bucket_bytes // bpe
    for (unit, sender, receivers), pieces in sorted(channels.items()):
        buckets: list[list[Piece]] = [[]]
        room = capacity  # elements left in the open bucket
        for p in pieces:
            src_in_place, dst_in_place = p.src_contiguous(), p.dst_contiguous()
            if (src_in_place and dst_in_place or (src_in_place or dst_in_place) and p.numel <= capacity) \
                    and p.numel * bpe >= direct_min_bytes:
                (packed if not (src_in_place and dst_in_place) else direct).append(
                    Message(unit, sender, receivers, (p,), src_in_place, dst_in_place))
                continue
            if p.slab_numel > capacity:
                raise PlanError(f"{p.name}: one slice of {p.slab_numel * bpe} bytes exceeds the bucket of "
                                f"{bucket_bytes} bytes; use a bucket of at least that size")
            offset, length = 0, p.full_range[1] - p.full_range[0]
            while offset < length:
                take = min(room // p.slab_numel, length - offset)
                if take == 0:
                    buckets.append([])
                    room = capacity
                    continue
                buckets[-1].append(p if (offset, take) == (0, length) else p.cut(offset, take))
                room -= take * p.slab_numel
                offset += take
        packed.extend(Message(unit, sender, receivers, tuple(b)) for b in buckets if b)
    # Stable sort: within a unit, every message in place on both sides, then the others, each in channel order.
    return tuple(sorted(direct + packed, key=lambda t: (t.unit, t.packed)))


@dataclass(frozen=True)
class Round:
    """Messages every rank posts as one batch: inside one unit, and packing at most ``round_bytes`` on any rank."""

    unit: int
    messages: tuple[Message, ...]

    def packed_numel(self, rank: int) -> int:
        """Elements ``rank`` packs (as sender) or unpacks (as receiver) in this round: its room in the bucket."""
        return sum(t.numel for t in self.messages if (rank == t.src_rank or rank in t.dst_ranks)
                   and not t.in_place_for(rank))


@lru_cache(maxsize=64)
def schedule_rounds(plan: ReallocPlan, bucket_bytes: int, direct_min_bytes: int = 1 << 18) -> tuple[Round, ...]:
    """The plan's messages (at most a quarter bucket) cut into rounds all ranks agree on.

    A round is one ``batch_isend_irecv`` on every rank taking part; a batch completes as a whole,
    so batches must match across ranks or two ranks could each wait on a batch holding a message
    the other posts only later. Cutting by the global order alone (a new round at each unit, where
    messages in place on both sides end and packed ones begin, and whenever some rank's packed
    elements would pass half the bucket) makes them match. Keeping the rounds that need no bucket
    apart lets a rank free bucket room without waiting for the large in-place messages.
    """
    bpe = plan.bytes_per_element
    capacity = bucket_bytes // 2 // bpe
    rounds: list[Round] = []
    current: list[Message] = []
    room: dict[int, int] = defaultdict(int)  # packed elements per rank in the open round
    for t in schedule_messages(plan, bucket_bytes // SLOTS, direct_min_bytes):
        packers = [r for r in (t.src_rank, *t.dst_ranks) if not t.in_place_for(r)]
        if current and (t.unit != current[0].unit or t.packed != current[-1].packed
                        or any(room[r] + t.numel > capacity for r in packers)):
            rounds.append(Round(current[0].unit, tuple(current)))
            current, room = [], defaultdict(int)
        current.append(t)
        for r in packers:
            room[r] += t.numel
    if current:
        rounds.append(Round(current[0].unit, tuple(current)))
    return tuple(rounds)
