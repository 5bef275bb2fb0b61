"""The non-finite guard: no training on NaN or inf, and no checkpoint of, or resume from, non-finite weights.

A NaN reward turns the advantages, the loss, the gradients and then every weight into NaN; DeepSpeed
skips a step only on fp16 overflow, and otherwise applies it. So before each train MFC every rank of
the MFC checks its input batch (rewards, advantages, log-probs, values: every floating key), and the
MFC's ranks agree on one flag (an all-reduce over its mesh) so that all of them skip, or all train.
``run.nonfinite`` says what a flagged step does: ``skip`` (the default: that MFC does not train this
step; the rank names the samples) or ``stop`` (the run ends with one line). ``run.max_skipped_steps``
consecutive skipped steps of one MFC end the run too: a reward that is always NaN must not exit 0.
A train MFC whose loss comes out non-finite from finite inputs ends the run: its weights may now be
damaged, and the checkpoint guard below keeps them out of every checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from restage.data.batch import Batch
from restage.errors import RestageError

POLICIES = ("skip", "stop")


class NonFiniteError(RestageError):
    """Training met NaN or inf (inputs, loss or weights)."""


def nonfinite_samples(batch: Batch) -> tuple[list[Any], list[str]]:
    """(ids of the samples with a non-finite value in any floating key, those keys); ids are dataset ids when
    the batch has them, else positions."""
    bad_seqs: set[int] = set()
    keys: list[str] = []
    starts = torch.tensor([0, *batch.seqlens]).cumsum(0)
    for key, value in {**batch.tokens, **batch.seqs}.items():
        if not value.is_floating_point():
            continue
        rows = ~torch.isfinite(value.reshape(value.shape[0], -1)).all(dim=1)
        if not bool(rows.any()):
            continue
        keys.append(key)
        where = rows.nonzero().flatten().cpu()
        if key in batch.tokens:  # token row -> its sequence
            where = torch.searchsorted(starts, where, right=True) - 1
        bad_seqs.update(int(i) for i in where)
    samples = sorted({s // batch.group_size for s in bad_seqs})
    return [batch.ids[i] if batch.ids else i for i in samples], keys


def any_rank(flag: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """True if ``flag`` holds on any rank of ``group`` (None: this rank alone)."""
    if group is None:
        return flag
    value = torch.tensor([1.0 if flag else 0.0], device=device)  # on the device: NCCL has no CPU tensors
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def nonfinite_stats(stats: dict[str, float]) -> list[str]:
    """The loss statistics that are not finite."""
    return [k for k, v in stats.items() if k.split("/")[-1].endswith("loss") and not math.isfinite(v)]


def finite_weights(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether every parameter this rank holds of ``modules`` is finite."""
    # Under ZeRO-3 a parameter is empty outside a gather; the rank's partition is its ds_tensor.
    held = (getattr(p, "ds_tensor", p) for m in modules for p in m.parameters())
    return all(bool(torch.isfinite(t.detach()).all()) for t in held if t.numel())


def finite_files(directory: Path) -> bool:
    """Whether every tensor of the safetensors files under ``directory`` (a checkpoint's ``<model>/hf/``) is finite;
    read one tensor at a time."""
    for file in sorted(directory.rglob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    return False
    return True
