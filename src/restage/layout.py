"""Meshes, strategies and layouts, the rank maps between them, and a cache of process groups.

Rank order inside a mesh is pp-major, then dp, then tp: the rank at mesh index
``pp * (dp * tp) + d * tp + t`` holds pipeline stage ``pp``, data-parallel replica ``d`` and
tensor-parallel shard ``t``. TP ranks are therefore adjacent (same node whenever possible).

Expert parallelism (``ep``, mixture-of-experts models) is carved out of the data-parallel ranks,
as Megatron-Core and DeepSpeed-MoE do: ``ep`` divides ``dp``, and the ``ep`` consecutive dp
indices of one block (same pp stage and tp rank) form an *ep group* that splits the experts
between them (ep-rank = dp index % ep; expert ``e`` of ``E`` lives on ep-rank ``e // (E / ep)``).
The dp indices with the same ep-rank form an *expert-dp group*, which holds the same experts.
A mesh still has dp*tp*pp ranks; everything but the experts is replicated over dp as without ep.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from restage.errors import LayoutError

if TYPE_CHECKING:  # annotations only: layout is plain data for the planner, which runs without torch
    from torch.distributed import ProcessGroup


@dataclass(frozen=True, order=True)
class Strategy:
    """Degrees of data, tensor and pipeline parallelism, and of expert parallelism inside dp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # experts split over this many of the dp ranks (a divisor of dp)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"strategy {name}={value!r} must be a positive integer")
        if self.dp % self.ep:
            raise LayoutError(f"strategy ep={self.ep} does not divide dp={self.dp}; experts are split over dp "
                              f"ranks, so use an ep that divides dp (or raise dp)")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def ep_rank(self, dp_index: int) -> int:
        """Which share of the experts the replica at ``dp_index`` holds."""
        return dp_index % self.ep

    def __str__(self) -> str:
        # ep only when it is used, so the names (and schedule files) of layouts without it are unchanged
        ep = f"ep{self.ep}" if self.ep > 1 else ""
        return f"dp{self.dp}{ep}tp{self.tp}pp{self.pp}"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Parse ``dp2tp2pp1`` or ``dp4ep2`` (any order, missing degrees are 1)."""
        parts = dict(re.findall(r"(dp|tp|pp|ep)(\d+)", text))
        if not parts or re.sub(r"(dp|tp|pp|ep)\d+", "", text):
            raise LayoutError(f"cannot read strategy {text!r}; write it like dp2tp2pp1 (or dp4ep2tp1pp1)")
        return cls(**{k: int(v) for k, v in parts.items()})


@dataclass(frozen=True, order=True)
class Coord:
    """Position of one rank inside a layout."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class Layout:
    """A mesh (global ranks, in mesh order) and a strategy over it."""

    mesh: tuple[int, ...]
    strategy: Strategy

    def __post_init__(self) -> None:
        object.__setattr__(self, "mesh", tuple(int(r) for r in self.mesh))
        if len(set(self.mesh)) != len(self.mesh):
            raise LayoutError(f"mesh {list(self.mesh)} repeats a rank; list each rank once")
        if any(r < 0 for r in self.mesh):
            raise LayoutError(f"mesh {list(self.mesh)} has a negative rank")
        if len(self.mesh) != self.strategy.world_size:
            raise LayoutError(
                f"mesh of {len(self.mesh)} ranks cannot hold {self.strategy} "
                f"({self.strategy.world_size} ranks); make dp*tp*pp equal the mesh size"
            )

    @classmethod
    def contiguous(cls, start: int, strategy: Strategy) -> Layout:
        """The layout over ranks ``start .. start + world_size - 1``."""
        return cls(tuple(range(start, start + strategy.world_size)), strategy)

    @property
    def size(self) -> int:
        return len(self.mesh)

    def check_world(self, world_size: int) -> None:
        """Refuse a layout that names ranks outside a world of ``world_size`` ranks."""
        outside = [r for r in self.mesh if r >= world_size]
        if outside:
            raise LayoutError(
                f"layout {self} uses ranks {outside} but only {world_size} ranks exist; "
                f"start more ranks or shrink the mesh"
            )

    def rank_at(self, pp: int, dp: int, tp: int) -> int:
        s = self.strategy
        if not (0 <= pp < s.pp and 0 <= dp < s.dp and 0 <= tp < s.tp):
            raise IndexError(f"coordinate pp={pp} dp={dp} tp={tp} outside {s}")
        return self.mesh[pp * s.dp * s.tp + dp * s.tp + tp]

    def coord(self, rank: int) -> Coord | None:
        """Coordinates of a global rank in this layout, or None if the rank is not in the mesh."""
        try:
            index = self.mesh.index(rank)
        except ValueError:
            return None
        s = self.strategy
        return Coord(pp=index // (s.dp * s.tp), dp=(index // s.tp) % s.dp, tp=index % s.tp)

    def __contains__(self, rank: object) -> bool:
        return rank in self.mesh

    def coords(self) -> Iterator[tuple[int, Coord]]:
        for rank in self.mesh:
            coord = self.coord(rank)
            assert coord is not None
            yield rank, coord

    def tp_groups(self) -> list[tuple[int, ...]]:
        s = self.strategy
        return [tuple(self.rank_at(p, d, t) for t in range(s.tp)) for p in range(s.pp) for d in range(s.dp)]

    def dp_groups(self) -> list[tuple[int, ...]]:
        s = self.strategy
        return [tuple(self.rank_at(p, d, t) for d in range(s.dp)) for p in range(s.pp) for t in range(s.tp)]

    def pp_groups(self) -> list[tuple[int, ...]]:
        s = self.strategy
        return [tuple(self.rank_at(p, d, t) for p in range(s.pp)) for d in range(s.dp) for t in range(s.tp)]

    def mp_groups(self) -> list[tuple[int, ...]]:
        """Model-parallel groups: the tp x pp ranks that share a dp index (one whole copy of the model).

        DeepSpeed asks its mpu for this group while it builds the ZeRO optimizer (global gradient norm,
        overflow checks); it equals the tp group where pp is 1 and the pp group where tp is 1."""
        s = self.strategy
        return [tuple(self.rank_at(p, d, t) for p in range(s.pp) for t in range(s.tp)) for d in range(s.dp)]

    def ep_groups(self) -> list[tuple[int, ...]]:
        """The ranks that split the experts between them: ``ep`` consecutive dp indices, same pp stage and tp rank."""
        s = self.strategy
        return [tuple(self.rank_at(p, b * s.ep + e, t) for e in range(s.ep))
                for p in range(s.pp) for b in range(s.dp // s.ep) for t in range(s.tp)]

    def edp_groups(self) -> list[tuple[int, ...]]:
        """Expert-data-parallel groups: the dp indices with the same ep-rank, which hold the same experts."""
        s = self.strategy
        return [tuple(self.rank_at(p, d, t) for d in range(e, s.dp, s.ep))
                for p in range(s.pp) for e in range(s.ep) for t in range(s.tp)]

    def group_of(self, rank: int, kind: str) -> tuple[int, ...]:
        """The ``kind`` ("tp", "dp", "pp", "mp", "ep" or "edp") group of ``rank``."""
        groups = {"tp": self.tp_groups, "dp": self.dp_groups, "pp": self.pp_groups, "mp": self.mp_groups,
                  "ep": self.ep_groups, "edp": self.edp_groups}[kind]()
        for group in groups:
            if rank in group:
                return group
        raise LayoutError(f"rank {rank} is not in layout {self}")

    def all_groups(self) -> list[tuple[int, ...]]:
        """Every multi-rank group a model in this layout needs, deduplicated, in one order on every rank: tp, dp
        and pp groups, the model-parallel (tp x pp) groups DeepSpeed's mpu hands out, with ep the ep and
        expert-dp groups, and the whole mesh. This is the one rule: the runtime creates exactly these at start-up
        (``comm_budget.run_groups``), and nothing asks for a group outside them."""
        groups = self.tp_groups() + self.dp_groups() + self.pp_groups() + self.mp_groups() + [tuple(self.mesh)]
        if self.strategy.ep > 1:
            groups += self.ep_groups() + self.edp_groups()
        return list(dict.fromkeys(g for g in groups if len(g) > 1))

    def to_json(self) -> dict:
        s = self.strategy
        # ep only when used: a schedule without expert parallelism reads as before (format version unchanged)
        return {"mesh": list(self.mesh), "dp": s.dp, "tp": s.tp, "pp": s.pp, **({"ep": s.ep} if s.ep > 1 else {})}

    @classmethod
    def from_json(cls, data: dict) -> Layout:
        return cls(tuple(data["mesh"]), Strategy(dp=data["dp"], tp=data["tp"], pp=data["pp"], ep=data.get("ep", 1)))

    def __str__(self) -> str:
        m = self.mesh
        ranks = f"{m[0]}-{m[-1]}" if m == tuple(range(m[0], m[0] + len(m))) else ",".join(map(str, m))
        return f"[{ranks}]{self.strategy}"


class ProcessGroups:
    """Cache of torch.distributed groups keyed by their (sorted) ranks.

    ``torch.distributed.new_group`` must be called by every rank of the world in the same
    order, so groups are created collectively up front from the full list a schedule needs
    (sorted, deduplicated), never lazily on a subset of ranks. Each group is then warmed: its
    members run one small all-reduce on it, in the same sorted order everywhere (a single global
    order cannot deadlock). With NCCL that builds the group's communicator now, under start-up,
    and a later batched P2P among a few of its ranks is allowed (a batched P2P that is a group's
    first call would need all of them). ``timeout_seconds``: each group's data-plane timeout;
    ``startup_timeout_seconds`` (if given) bounds the creation and warm-up instead, while peers may
    still be loading (a gloo group's creation waits on the store for every member).
    """

    def __init__(self, groups: Iterable[Iterable[int]], backend: str | None = None,
                 singletons: bool | Iterable[int] = False, timeout_seconds: float | None = None,
                 startup_timeout_seconds: float | None = None):
        # lazy: layout is plain data for the planner, which runs without torch; only process groups need it
        import torch
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _set_pg_timeout  # no public setter

        from restage.device import rank_device

        self._rank = dist.get_rank()
        self._groups: dict[tuple[int, ...], ProcessGroup] = {}
        wanted = {tuple(sorted(g)) for g in groups if len(tuple(g)) > 1}
        # DeepSpeed wants a real group even where a degree is 1: True makes one for every rank,
        # an iterable only for the ranks named (each is a communicator, so name only those needed).
        lone = range(dist.get_world_size()) if singletons is True else (singletons or ())
        wanted |= {(r,) for r in lone}
        timeout = None if timeout_seconds is None else datetime.timedelta(seconds=timeout_seconds)
        during_startup = timeout if startup_timeout_seconds is None else datetime.timedelta(seconds=startup_timeout_seconds)
        for ranks in sorted(wanted):
            group = dist.new_group(list(ranks), backend=backend, timeout=during_startup)
            if self._rank in ranks:
                self._groups[ranks] = group
        for ranks, group in sorted(self._groups.items()):
            if len(ranks) > 1:
                on_gpu = dist.get_backend(group) == "nccl"
                dist.all_reduce(torch.zeros(1, device=rank_device(on_gpu)), group=group)
            if during_startup != timeout and timeout is not None:
                _set_pg_timeout(timeout, group)  # from now on: the data plane's timeout (NCCL's watchdog)

    def get(self, ranks: Iterable[int]) -> ProcessGroup | None:
        """The group over ``ranks``; None for a single rank unless singletons were made. The caller must be a member."""
        key = tuple(sorted(ranks))
        if len(key) <= 1 and key not in self._groups:
            return None
        try:
            return self._groups[key]
        except KeyError:
            raise KeyError(f"rank {self._rank} has no group over {key}; it was not requested up front") from None
