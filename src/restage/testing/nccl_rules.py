"""NCCL's rules, checked on CPU: make gloo fail where NCCL would fail or hang.

Off unless ``RESTAGE_NCCL_RULES`` is set in the environment (``install()`` then patches
``torch.distributed``; nothing is patched otherwise). ``runtime.control.spawn`` sets it for its children
and the test suite's ``conftest.py`` sets it for ``restage run``/mpirun-launched ranks. Rules:

a. ``first-batched-p2p``: a ``batch_isend_irecv`` as a group's first call must involve every rank
   of the group (NCCL builds the group's communicator then; ranks outside the batch never join).
b. ``crossing-p2p``: unbatched send/recv between two ranks must be complementary in order (A's
   k-th op to B is a send iff B's k-th op with A is a receive); NCCL blocks where gloo buffers.
   Checked at every world ``barrier``, at ``destroy_process_group`` and at ``check()``.
c. ``device``: a data-plane collective or P2P takes tensors on the rank's device. With
   ``RESTAGE_NCCL_RULES=device`` the rank's device on CPU is ``cpu:0`` and a move to the host
   (``.cpu()``, ``.to("cpu")``) returns a ``HostTensor``, so a stray ``.cpu()`` is caught.
d. ``bound``: at most ``max_groups`` communicators (world + ``new_group``) and ``max_pairs``
   distinct rank pairs of unbatched P2P (one 2-rank NCCL communicator each); see ``set_bound``.
e. ``watchdog``: an op must complete within its group's timeout counted from when it was queued
   (NCCL's watchdog aborts it; gloo's receives just keep waiting).

Groups created with ``backend="gloo"`` are host groups: NCCL's rules do not apply to them.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import restage.device
from restage.testing.host_tensors import HostTensor, host_move, same_device

ENV = "RESTAGE_NCCL_RULES"
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
                "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single")
_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}


class NcclRuleError(RuntimeError):
    """A call that NCCL would refuse or hang on; names the rule, the rank, the group and the op."""

    def __init__(self, rule: str, rank: int, group: str, op: str, detail: str):
        super().__init__(f"NCCL rule '{rule}' broken on rank {rank}, group {group}, op {op}: {detail}")
        self.rule = rule


@dataclass
class _State:
    rank: int
    device_mode: bool
    side_group: dist.ProcessGroup
    warm: set[int] = field(default_factory=set)  # id() of groups that have had a collective
    host_groups: set[int] = field(default_factory=set)
    groups: int = 1  # the world
    pairs: set[tuple[int, int]] = field(default_factory=set)
    p2p_log: dict[int, list[str]] = field(default_factory=dict)  # peer -> "send"/"recv", unbatched, in order
    p2p_seen: dict[int, int] = field(default_factory=dict)  # peer -> ops with it checked by earlier check() calls
    max_groups: int | None = None
    max_pairs: int | None = None


_state: _State | None = None
_original: dict[str, Callable[..., Any]] = {}  # what install() replaced, by name
_in_batch = threading.local()


def enabled() -> bool:
    return _state is not None


def _active() -> _State:
    """The rules' state; only the patched functions call this, and they are in place only while it exists."""
    assert _state is not None
    return _state


def rank_device() -> torch.device:
    """The device this rank's data-plane tensors live on: its GPU, ``cpu:0`` under the device rule, else cpu."""
    if not torch.cuda.is_available() and _state is not None and _state.device_mode:
        return torch.device("cpu", 0)
    return restage.device.rank_device()


def set_bound(max_groups: int | None = None, max_pairs: int | None = None) -> None:
    """Fail once more than ``max_groups`` communicators or ``max_pairs`` unbatched-P2P rank pairs exist."""
    if _state is None:
        return
    _state.max_groups, _state.max_pairs = max_groups, max_pairs
    _check_bound("set_bound", "-")


def _name(group: dist.ProcessGroup | None) -> str:
    if group is None or group is dist.GroupMember.WORLD:
        return "world"
    try:
        return "ranks " + ",".join(map(str, dist.get_process_group_ranks(group)))
    except (RuntimeError, ValueError):
        return repr(group)


def _fail(rule: str, group: dist.ProcessGroup | None, op: str, detail: str) -> NoReturn:
    raise NcclRuleError(rule, _active().rank, _name(group), op, detail)


def _key(group: dist.ProcessGroup | None) -> int:
    return id(group if group is not None else dist.GroupMember.WORLD)


def _exempt(group: dist.ProcessGroup | None) -> bool:
    return _key(group) in _active().host_groups


def _check_tensors(op: str, group: dist.ProcessGroup | None, tensors: Iterable[object]) -> None:
    _active()
    device = rank_device()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        if isinstance(tensor, HostTensor) or not same_device(tensor.device, device):
            _fail("device", group, op, f"a tensor on the host ({tensor.device}) where the rank's device is {device}; "
                  f"move it with .to(rank_device())")


def _flatten(values: Iterable[object]) -> list[object]:
    out: list[object] = []
    for value in values:
        if isinstance(value, (list, tuple)):
            out += _flatten(value)
        else:
            out.append(value)
    return out


def _check_bound(op: str, group_name: str) -> None:
    state = _active()
    if state.max_groups is not None and state.groups > state.max_groups:
        raise NcclRuleError("bound", state.rank, group_name, op,
                            f"{state.groups} communicators exceed the bound of {state.max_groups}")
    if state.max_pairs is not None and len(state.pairs) > state.max_pairs:
        raise NcclRuleError("bound", state.rank, group_name, op,
                            f"{len(state.pairs)} P2P rank pairs {sorted(state.pairs)} exceed the bound of "
                            f"{state.max_pairs}")


def _bound_args(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return inspect.signature(_original[name]).bind(*args, **kwargs).arguments


class _WatchedWork:
    """A ``Work`` whose ``wait`` fails like NCCL's watchdog once the op took longer than its group's timeout."""

    def __init__(self, work: dist.Work, op: str, group: dist.ProcessGroup | None, queued: float):
        self._work, self._op, self._group, self._queued = work, op, group, queued

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        out = self._work.wait(*args, **kwargs)
        _watchdog(self._op, self._group, self._queued)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _timeout_seconds(group: dist.ProcessGroup | None) -> float | None:
    group = group or dist.GroupMember.WORLD
    if group is None:  # no world (yet): no timeout to read
        return None
    try:
        backend = group._get_backend(rank_device())
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return None


def _watchdog(op: str, group: dist.ProcessGroup | None, queued: float) -> None:
    took, limit = time.monotonic() - queued, _timeout_seconds(group)
    if limit is not None and took > limit:
        _fail("watchdog", group, op, f"took {took:.1f} s from when it was queued, over the group's timeout of "
              f"{limit:.0f} s (NCCL's watchdog would abort the job); wait for the peers first or raise the timeout")


def _watched(op: str, group: dist.ProcessGroup | None, queued: float, out: Any) -> Any:
    if isinstance(out, list):
        return [_watched(op, group, queued, work) for work in out]
    if out is None:
        _watchdog(op, group, queued)
        return out
    return _WatchedWork(out, op, group, queued)


def _collective(name: str) -> Callable[..., Any]:
    original = _original[name]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        given = _bound_args(name, args, kwargs)
        group = given.get("group")
        if _exempt(group):
            return original(*args, **kwargs)
        _check_tensors(name, group, _flatten([v for k, v in given.items() if k != "group"]))
        _active().warm.add(_key(group))
        return _watched(name, group, time.monotonic(), original(*args, **kwargs))

    return wrapped


def _p2p(name: str) -> Callable[..., Any]:
    original = _original[name]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        given = _bound_args(name, args, kwargs)
        group = given.get("group")
        if getattr(_in_batch, "active", False) or _exempt(group):
            return original(*args, **kwargs)
        _check_tensors(name, group, [given["tensor"]])
        peer = given.get("dst", given.get("src"))
        if peer is None:  # given as group_dst/group_src: translate to a global rank
            local = given.get("group_dst", given.get("group_src"))
            assert local is not None, "a P2P op names its peer (dst/src or group_dst/group_src)"
            peer = dist.get_global_rank(group, local) if group is not None else local
        peer = int(peer)
        state = _active()
        log = state.p2p_log.setdefault(peer, [])
        log.append(_P2P[name])
        # Blocking ops may hang gloo too, so they compare with the peer's op before it runs.
        _compare_now(name, group, peer, len(log) - 1, wait=name in ("send", "recv"))
        state.pairs.add((min(state.rank, peer), max(state.rank, peer)))
        _check_bound(name, _name(group))
        queued = time.monotonic()
        out = original(*args, **kwargs)
        if name in ("send", "recv"):  # blocking; recv returns the sender's rank
            _watchdog(name, group, queued)
            return out
        return _watched(name, group, queued, out)

    return wrapped


def _compare_now(name: str, group: dist.ProcessGroup | None, peer: int, k: int, wait: bool) -> None:
    """Post this rank's k-th unbatched op with ``peer`` on the store; with ``wait``, compare with the peer's k-th."""
    state = _active()
    store, me = c10d._get_default_store(), state.rank  # the rendezvous store every rank already shares
    kind = state.p2p_log[peer][k]
    store.set(f"restage_nccl_rules/{me}/{peer}/{state.p2p_seen.get(peer, 0) + k}", kind)
    if not wait:
        return
    theirs = store.get(f"restage_nccl_rules/{peer}/{me}/{state.p2p_seen.get(peer, 0) + k}").decode()
    if theirs == kind:
        _fail("crossing-p2p", group, f"{name} #{k} with rank {peer}",
              f"rank {me}'s op #{k} with rank {peer} is a {kind}, and so is rank {peer}'s with rank {me}; "
              f"NCCL blocks where gloo may buffer: order them send/recv against recv/send, or batch them")


def _batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> Any:
    group = p2p_op_list[0].group if p2p_op_list else None
    if p2p_op_list and not _exempt(group):
        state = _active()
        _check_tensors("batch_isend_irecv", group, [op.tensor for op in p2p_op_list])
        if _key(group) not in state.warm:
            members = set(dist.get_process_group_ranks(group or dist.GroupMember.WORLD))
            taking_part = {state.rank} | {int(op.peer) for op in p2p_op_list}
            if taking_part != members:
                _fail("first-batched-p2p", group, "batch_isend_irecv",
                      f"first call on the group, but only ranks {sorted(taking_part)} take part; run a collective "
                      f"on the group first (ProcessGroups warms its groups) or batch over every rank of it")
            state.warm.add(_key(group))
    _in_batch.active = True
    try:
        queued = time.monotonic()
        works = _original["batch_isend_irecv"](p2p_op_list)
        return works if _exempt(group) else _watched("batch_isend_irecv", group, queued, works)
    finally:
        _in_batch.active = False


def _new_group(*args: Any, **kwargs: Any) -> Any:
    group = _original["new_group"](*args, **kwargs)
    state = _active()
    if kwargs.get("backend") == "gloo":
        state.host_groups.add(_key(group))
    else:
        state.groups += 1
        _check_bound("new_group", "-")
    return group


def check() -> None:
    """Exchange the unbatched P2P logs of all ranks and check them; every rank of the world must call it."""
    if _state is None:
        return
    logs: list[Any] = [None] * dist.get_world_size()  # per rank: (its P2P log, its pairs)
    _original["all_gather_object"](logs, (_state.p2p_log, sorted(_state.pairs)), group=_state.side_group)
    for peer, ops in _state.p2p_log.items():
        _state.p2p_seen[peer] = _state.p2p_seen.get(peer, 0) + len(ops)
    _state.p2p_log = {}
    me = _state.rank
    for peer, mine in logs[me][0].items():
        theirs = logs[peer][0].get(me, [])
        for k, kind in enumerate(mine):
            other = theirs[k] if k < len(theirs) else None
            if other is None or other == kind:
                _fail("crossing-p2p", None, f"{kind} #{k} with rank {peer}",
                      f"rank {me} did {mine} with rank {peer}, which did {theirs} with rank {me}; each send needs "
                      f"the peer's receive at the same position (NCCL blocks; batch them with batch_isend_irecv)")
    _state.pairs |= {tuple(pair) for _, pairs in logs for pair in pairs}
    _check_bound("check", "world")


def _barrier(*args: Any, **kwargs: Any) -> Any:
    out = _original["barrier"](*args, **kwargs)
    group = _bound_args("barrier", args, kwargs).get("group")
    _active().warm.add(_key(group))
    if group in (None, dist.GroupMember.WORLD):
        check()
    return out


def _destroy_process_group(group: dist.ProcessGroup | None = None) -> None:
    original = _original["destroy_process_group"]
    if group in (None, dist.GroupMember.WORLD) and _state is not None:
        check()
        uninstall()
    original(group)


def install(device_mode: bool | None = None) -> None:
    """Patch torch.distributed (after ``init_process_group``) when ``RESTAGE_NCCL_RULES`` is set, or when asked."""
    global _state
    mode = os.environ.get(ENV, "")
    if _state is not None or (device_mode is None and mode in ("", "0")):
        return
    device_mode = bool(device_mode) or mode == "device"
    _original.update({name: getattr(dist, name) for name in
                      (*_COLLECTIVES, *_P2P, "barrier", "batch_isend_irecv", "new_group", "destroy_process_group",
                       "all_gather_object")})
    side = dist.new_group(backend="gloo")  # for the layer's own exchanges; not one of the program's communicators
    _state = _State(rank=dist.get_rank(), device_mode=device_mode and not torch.cuda.is_available(), side_group=side)
    _state.host_groups.add(_key(side))
    for name in _COLLECTIVES:
        setattr(dist, name, _collective(name))

    for name in _P2P:  # c10d's own name too: P2POp checks its op against it
        setattr(dist, name, _p2p(name))
        setattr(c10d, name, getattr(dist, name))
    dist.batch_isend_irecv, dist.barrier = _batch_isend_irecv, _barrier
    dist.new_group, dist.destroy_process_group = _new_group, _destroy_process_group
    if _state.device_mode:
        _original["cpu"], _original["to"] = torch.Tensor.cpu, torch.Tensor.to
        for name in ("cpu", "to"):
            setattr(torch.Tensor, name, host_move(name, _original[name]))
    bound = os.environ.get("RESTAGE_NCCL_MAX_GROUPS"), os.environ.get("RESTAGE_NCCL_MAX_PAIRS")
    if any(bound):
        set_bound(*(int(b) if b else None for b in bound))


def uninstall() -> None:
    """Undo every patch (``destroy_process_group`` does it)."""
    global _state
    if _state is None:
        return

    for name in ("cpu", "to"):
        if name in _original:
            setattr(torch.Tensor, name, _original.pop(name))
    for name, fn in _original.items():
        setattr(dist, name, fn)
        if name in _P2P:
            setattr(c10d, name, fn)
    _original.clear()
    _state = None
