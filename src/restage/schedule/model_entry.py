"""One model as the run holds it: what the planner resolved for it (architecture, checkpoint, precision, ZeRO,
offload, optimizer, LoRA in ``arch.lora``, value head, home layout). The runtime loads and trains it from this
entry alone (``runtime/store/model_store.py``, ``runtime/store/zero_engines.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from restage.config.optim import OptimConfig
from restage.layout import Layout
from restage.models.arch import ModelConfig

CRITIC_NAMES = ("critic", "reward")  # models by these names run with a value head whatever their checkpoint holds


def runs_with_value_head(name: str, arch: ModelConfig, init_critic_from_lm: bool) -> bool:
    """Whether a model runs with a value head (a critic or reward model), whatever its checkpoint says."""
    return arch.is_critic or init_critic_from_lm or name in CRITIC_NAMES


def effective_zero_stage(zero_stage: int, offload_optimizer: bool, dp: int, ep: int = 1) -> int:
    """The ZeRO stage the engine really uses: 0 where ZeRO-1/2 would partition over one DP rank, 1 for a
    ZeRO-0 model under ep (whose gradient norm DeepSpeed gets right only with ZeRO, ``expert_engine``).

    With dp == 1 stages 1 and 2 keep every optimizer state and gradient on the one rank anyway,
    but their partition bookkeeping costs time on every backward and step (~9% of a tiny GRPO
    step on CPU in an interleaved A/B of `restage run jobs/grpo_tiny.yaml -n 1`, 3 runs each).
    Optimizer offload needs ZeRO, and ZeRO-3 manages parameters itself: both keep their stage.
    """
    if ep > 1 and zero_stage == 0:
        return 1
    if dp == 1 and zero_stage in (1, 2) and not offload_optimizer:
        return 0
    return zero_stage


@dataclass(frozen=True)
class ModelEntry:
    """One model as the run holds it (module docstring)."""

    arch: ModelConfig
    path: str
    preset: str
    trainable: bool
    dtype: str
    zero_stage: int  # as configured; the engine's is ``engine_zero_stage``
    gradient_checkpointing: bool
    offload_optimizer: bool
    offload_params: bool
    offload_when_idle: bool
    home_mfc: str  # the MFC whose layout is the model's home
    home_layout: Layout
    # A frozen model held 1/dp per rank of its home layout (runtime/store/sharded_frozen.py).
    shard_frozen: bool = False
    critic: bool = False  # runs with a value head (``runs_with_value_head``), whatever ``arch`` says
    optim: OptimConfig = OptimConfig()
    router_aux_loss_coef: float | None = None  # mixture of experts: load-balancing loss weight; None: config.json's

    @property
    def held_arch(self) -> ModelConfig:
        """The architecture the run holds the model in: ``arch``, with a value head where it runs with one."""
        return self.arch.as_critic() if self.critic and not self.arch.is_critic else self.arch

    @property
    def engine_zero_stage(self) -> int:
        """The ZeRO stage its DeepSpeed engine uses over its home layout (``effective_zero_stage``)."""
        strategy = self.home_layout.strategy
        return effective_zero_stage(self.zero_stage, self.offload_optimizer, strategy.dp, strategy.ep)

    def to_json(self) -> dict[str, Any]:
        # shard_frozen is written only when set, as in version 1, so the schedules of jobs without it keep its JSON.
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "shard_frozen"}
        sharded = {"shard_frozen": True} if self.shard_frozen else {}
        return out | {"arch": self.arch.to_json(), "home_layout": self.home_layout.to_json(),
                      "optim": self.optim.to_json()} | sharded

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelEntry:
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        return cls(**values | {"arch": ModelConfig.from_json(data["arch"]),
                               "home_layout": Layout.from_json(data["home_layout"]),
                               "optim": OptimConfig.from_json(data.get("optim", {}))})
