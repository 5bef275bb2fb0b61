"""A trainable model's AdamW and LR schedule (``models.<name>.optim``): one dataclass for the config section and
the schedule's model entry, which carries it to the runtime (``schedule/model_entry.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from restage.config.choices import LrSchedule


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0
    lr_schedule: LrSchedule = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"betas": list(self.betas)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OptimConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "betas" in values:
            values["betas"] = (float(values["betas"][0]), float(values["betas"][1]))
        return cls(**values)
