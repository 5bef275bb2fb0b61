"""A model of an experiment as the planner sees it: its architecture and how it is trained and held."""

from __future__ import annotations

from dataclasses import dataclass

from restage.models.arch import ModelConfig
from restage.plan.compute import DTYPE_BYTES


@dataclass(frozen=True)
class ModelRole:
    """One model of an experiment as the planner sees it: architecture and how it is trained."""

    name: str
    arch: ModelConfig
    dtype: str = "bf16"
    trainable: bool = False
    zero_stage: int = 1
    gradient_checkpointing: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_when_idle: bool = False
    # A frozen model's parameters partitioned over the DP ranks and all-gathered layer by layer in each forward
    # (DeepSpeed ZeRO-3 / FSDP inference, as the peers run reference and reward models). Restage's runtime runs it
    # too (``runtime/store/sharded_frozen.py``): ``models.<m>.shard_frozen`` sets it, ``plan.shard_frozen: auto`` lets the
    # search choose it (``planner.sharded_variant``), and ``plan/peers/defaults.py`` sets it for the peers that shard.
    shard_frozen: bool = False
    # Whether the sharded gathers are prefetched, the next layer's during this layer's compute: DeepSpeed ZeRO-3
    # (stage3_prefetch_bucket_size) and FSDP (forward_prefetch) do, as the peers run them (plan/peers/defaults.py);
    # restage's runtime/store/sharded_frozen.py gathers each unit as its forward starts, so all its gathers are exposed.
    prefetch_gathers: bool = False
    path: str = ""
    preset: str = ""

    @property
    def bytes_per_element(self) -> int:
        return DTYPE_BYTES[self.dtype]
