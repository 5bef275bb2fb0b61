"""Lifecycle of one copy of a model on one rank: free it after its MFC, offload it to CPU memory and back.

A copy made by reallocation for one MFC (a generation or inference layout) is freed right
after that MFC; the trained copy (the DeepSpeed engine's module) is never freed or offloaded
here (DeepSpeed owns its memory). An idle frozen model (reference, reward) can sit in CPU
memory between its MFCs: :meth:`ModelCopy.offload` copies it into pinned host tensors and
releases the device memory, :meth:`ModelCopy.reload` copies it back. Since a frozen model
never changes, the host copy stays valid, so every offload after the first moves nothing;
a reference updated by an EMA says so with :meth:`ModelCopy.changed`.

The tensors are swapped in place (``tensor.data = ...``), so a module holding them sees the
move without being rebuilt. On a CPU-only machine "device" and "host" are both CPU memory:
the same code runs, as a real copy, which is what the tests exercise.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class ModelCopy:
    """The parameters (and buffers) of one copy of a model on this rank, and where they live now.

    ``location`` is ``device``, ``host`` (offloaded) or ``freed``.
    """

    def __init__(self, name: str, tensors: Mapping[str, torch.Tensor] | torch.nn.Module, *, trainable: bool):
        if isinstance(tensors, torch.nn.Module):
            tensors = {**dict(tensors.named_parameters()), **dict(tensors.named_buffers())}
        self.name, self.trainable = name, trainable
        self.tensors: dict[str, torch.Tensor] = dict(tensors)
        self._shapes = {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items()}
        self._host: dict[str, torch.Tensor] | None = None  # pinned copies; valid while the weights do not change
        self.location = "device"

    def device_bytes(self) -> int:
        """Bytes this copy holds outside host memory (0 once freed or offloaded)."""
        return 0 if self.location != "device" else sum(_nbytes(t) for t in self.tensors.values())

    def free(self) -> int:
        """Release the memory of a copy made for one MFC; returns the bytes released."""
        if self.trainable:
            raise ValueError(f"{self.name}: the trained copy is never freed; free only copies made for an MFC")
        released = self.device_bytes()
        for t in self.tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self._host = None
        self.location = "freed"
        return released

    def materialize(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Give a freed copy fresh (uninitialised) storage again, e.g. as a reallocation's destination."""
        for k, t in self.tensors.items():
            shape, dtype = self._shapes[k]
            t.data = torch.empty(shape, dtype=dtype, device=device)
        self.location = "device"
        return self.tensors

    def offload(self) -> int:
        """Move a frozen copy to (pinned) host memory; returns the bytes copied (0 if the host copy is current)."""
        if self.trainable:
            raise ValueError(f"{self.name}: a trainable model's memory is DeepSpeed's to offload, not the runtime's")
        if self.location != "device":
            return 0
        copied = 0
        if self._host is None:
            pin = torch.cuda.is_available()
            self._host = {}
            for k, t in self.tensors.items():
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                host.copy_(t.detach(), non_blocking=pin)
                self._host[k] = host
                copied += _nbytes(t)
            if pin:
                torch.cuda.current_stream().synchronize()  # the host copy must be complete before it is trusted
        for k, t in self.tensors.items():
            t.data = self._host[k]  # the device memory goes back to the allocator
        self.location = "host"
        return copied

    def changed(self) -> None:
        """The weights were updated in place (a reference EMA): a host copy taken earlier is stale.

        Offloaded, the host tensors are the weights themselves, so they stay current; on the
        device, the next offload must copy again.
        """
        if self.location == "device":
            self._host = None

    def reload(self, device: torch.device) -> int:
        """Bring an offloaded copy back to ``device``; returns the bytes copied."""
        if self.location != "host":
            return 0
        host = self._host
        assert host is not None  # offload made it; free and changed drop it only where the location is not "host"
        copied = 0
        for k, t in self.tensors.items():
            on_device = torch.empty(t.shape, dtype=t.dtype, device=device)
            on_device.copy_(host[k], non_blocking=host[k].is_pinned())
            t.data = on_device
            copied += _nbytes(on_device)
        self.location = "device"
        return copied
