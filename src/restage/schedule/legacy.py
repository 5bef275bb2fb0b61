"""Schedules of format version 1, read into today's: the facts version 1 left in the config it carried (the
execution mode, each model's optimizer, value head and router loss weight) moved to their typed fields."""

from __future__ import annotations

from typing import Any

from restage.models.arch import ModelConfig
from restage.schedule.model_entry import runs_with_value_head


def upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A version-1 schedule's JSON as version 2's (``file.SCHEDULE_FORMAT_VERSION``)."""
    config = data.get("config") or {}
    plan = config.get("plan") or {}
    if plan.get("execution", "sync") == "async":
        execution = {"mode": "async", "staleness": plan.get("staleness", 1), "push_every": plan.get("push_every", 1),
                     "partial_rollouts": bool(plan.get("partial_rollouts", False))}
    else:
        execution = {"mode": "sync"}
    specs = config.get("models") or {}
    models = {}
    for name, entry in data["models"].items():
        spec = specs.get(name) or {}
        critic = runs_with_value_head(name, ModelConfig.from_json(entry["arch"]),
                                      bool(spec.get("init_critic_from_lm", False)))
        models[name] = entry | {"critic": critic, "optim": spec.get("optim") or {},
                                "router_aux_loss_coef": spec.get("router_aux_loss_coef")}
    return data | {"format_version": 2, "execution": execution, "models": models}
