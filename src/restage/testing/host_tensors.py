"""The device rule's marks (``nccl_rules``, rule c): with ``RESTAGE_NCCL_RULES=device`` a CPU rank's device is
``cpu:0`` and a move to the host returns a ``HostTensor``, so a collective given one fails as NCCL would
("no backend for cpu"). Compare devices with ``same_device``, which takes ``cpu:0`` for the cpu it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class HostTensor(torch.Tensor):
    """A tensor moved to the host while the rank's device is ``cpu:0``; ops on it stay marked."""


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality that treats ``cpu:0`` (the device rule's stand-in device) as the cpu it is."""
    a, b = torch.device(a), torch.device(b)
    if a.type == "cpu" and b.type == "cpu":
        return True
    return a == b


def host_move(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.Tensor.cpu`` or ``.to`` (``name``, ``original``) returning a ``HostTensor`` for a move to the host."""

    def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if name == "cpu":
            return out.as_subclass(HostTensor) if type(out) is torch.Tensor else out
        target = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
        if target is None:
            return out
        target = torch.device(target)
        if target.type == "cpu" and target.index is None and type(out) is torch.Tensor:
            return out.as_subclass(HostTensor)
        if target.type == "cpu" and target.index is not None and isinstance(out, HostTensor):
            return out.as_subclass(torch.Tensor)
        return out

    return wrapped
