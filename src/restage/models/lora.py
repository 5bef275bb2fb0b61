"""LoRA: low-rank adapters on a frozen decoder, applied as a transform after the decoder is built.

``apply_lora`` swaps each targeted ``ColumnParallelLinear`` / ``RowParallelLinear`` of a ``StageModule``
for a :class:`LoraLinear` that keeps the base ``weight`` (and ``bias``) under the same canonical names and
adds ``lora_A.weight`` ``[r, in]`` and ``lora_B.weight`` ``[out, r]`` (their TP split is declared in
``sharding._with_lora``). Forward: ``y = base(x) + (alpha / r) * B(A(x))``. Every parameter but the
adapters (and a critic's fresh scalar head) is frozen, so the DeepSpeed engine trains only those.

Adapters start as PEFT's do: B = 0 (the model starts as its base) and A kaiming-uniform (a = sqrt(5)),
drawn from a generator seeded by the parameter's name so every rank, layout and run agrees.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.types import Device

from restage.models.arch import ModelConfig
from restage.models.parallel import ColumnParallelLinear, ParallelContext, RowParallelLinear, copy_to_tp, reduce_from_tp
from restage.models.sharding import LORA_TARGETS, ShardSpec, is_adapter


class Factor(nn.Module):
    """One low-rank factor (``.weight``), called as a module so a ZeRO-3 engine gathers it like any linear.

    ``replicated_over``: the TP context of a factor every TP rank holds whole while the other factor is split;
    each rank's gradient of it is then a partial sum, which ``copy_to_tp`` on the weight all-reduces over TP.
    """

    def __init__(self, shape: tuple[int, int], dtype: torch.dtype, device: Device,
                 replicated_over: ParallelContext | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        self.replicated_over = replicated_over

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.replicated_over is None else copy_to_tp(self.weight, self.replicated_over)
        return F.linear(x, weight)


class LoraLinear(nn.Module):
    """A TP linear plus ``scale * B(A(x))``; the base weight and bias keep their names and are frozen.

    Column-parallel base (output split): A is whole, B holds this rank's output rows, so
    ``B_local A x`` is exactly this rank's slice of the update. Row-parallel base (input split): A
    holds this rank's input columns and B is whole; ``B (A_local x_local)`` summed over TP is
    ``B A x`` because B is linear, so the update joins the base's partial sum *before* the one
    all-reduce the base does anyway (no extra collective in the forward). In both cases the whole
    factor's gradient on one rank covers only that rank's slice; ``Factor`` all-reduces it over TP.
    """

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, rank: int, scale: float, ctx: ParallelContext):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.row = isinstance(base, RowParallelLinear)
        self.ctx, self.scale = ctx, scale
        out_features, in_features = base.weight.shape
        dtype, device = base.weight.dtype, base.weight.device
        tp = ctx if ctx.tp_size > 1 else None
        self.lora_A = Factor((rank, in_features), dtype, device, None if self.row else tp)
        self.lora_B = Factor((out_features, rank), dtype, device, tp if self.row else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.scale * self.lora_B(self.lora_A(x))
        if not self.row:
            return F.linear(x, self.weight, self.bias) + update
        y = reduce_from_tp(F.linear(x, self.weight) + update, self.ctx)
        return y if self.bias is None else y + self.bias


def apply_lora(stage: nn.Module, cfg: ModelConfig, ctx: ParallelContext) -> None:
    """Wrap ``cfg.lora``'s target linears of every block of ``stage`` and freeze all but the adapters (in place)."""
    lora = cfg.lora
    assert lora is not None  # the decoder calls it for a LoRA model only
    for block in stage.get_submodule("layers").children():  # a StageModule's blocks
        for target in lora.target_modules:
            parent_name, attr = LORA_TARGETS[target].split(".")
            parent = getattr(block, parent_name)
            base = getattr(parent, attr)
            if base is not None:  # GPT-2 has no gate
                setattr(parent, attr, LoraLinear(base, lora.rank, lora.scale, ctx))
    for name, param in stage.named_parameters():
        param.requires_grad_(is_adapter(cfg, name))


def init_adapter(param: torch.Tensor, shard: ShardSpec) -> None:
    """Fill this rank's shard of a fresh adapter: B zero, A kaiming-uniform (a = sqrt(5)) seeded by its name."""
    with torch.no_grad():
        if shard.param.name.endswith("lora_B.weight"):
            param.zero_()
            return
        fan_in = shard.param.shape[1]
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
        generator = torch.Generator().manual_seed(zlib.crc32(shard.param.name.encode()))
        full = (torch.rand(shard.param.shape, generator=generator, dtype=torch.float64) * 2 - 1) * bound
        param.copy_(full[shard.index()].to(param.dtype))


def adapter_names(cfg: ModelConfig, names: list[str]) -> list[str]:
    """The trained parameters of a LoRA model among ``names``."""
    return [n for n in names if is_adapter(cfg, n)]
