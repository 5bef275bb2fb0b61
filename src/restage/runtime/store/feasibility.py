"""The runtime's start-up check of a schedule's layouts: ``models.sharding.layout_problem``, the rule the
planner's candidate generation applies too, over every layout the schedule puts a model in."""

from __future__ import annotations

from restage.models.sharding import layout_problem
from restage.runtime.dataplane.comm_budget import realloc_model_config
from restage.schedule.file import Schedule


def schedule_problem(schedule: Schedule, world_size: int) -> str | None:
    """Why the runtime refuses this schedule's layouts (what to change), or None: each model's home layout
    (trained there when the model is trainable) and every MFC's layout (a copy of its model is made there)."""
    archs = {name: realloc_model_config(schedule, name) for name in schedule.models}
    for name, info in schedule.models.items():
        problem = layout_problem(name, archs[name], info.home_layout.strategy, world_size, trained=info.trainable,
                                 zero_stage=info.zero_stage)
        if problem:
            return problem
    for entry in schedule.mfcs:
        problem = layout_problem(entry.mfc.model, archs[entry.mfc.model], entry.layout.strategy, world_size)
        if problem:
            return f"{entry.mfc.name}: {problem}"
    return None
