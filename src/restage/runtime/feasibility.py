"""The runtime's start-up check of a schedule's layouts: ``models.sharding.layout_problem``, the rule the
planner's candidate generation applies too, over every layout the schedule puts a model in."""

from __future__ import annotations

from restage.layout import Layout
from restage.models.sharding import layout_problem
from restage.runtime.comm_budget import realloc_model_config


def schedule_problem(schedule, experiment, world_size: int) -> str | None:
    """Why the runtime refuses this schedule's layouts (what to change), or None: each model's home layout
    (trained there when the model is trainable) and every MFC's layout (a copy of its model is made there)."""
    archs = {name: realloc_model_config(schedule, experiment, name) for name in schedule.models}
    for name, info in schedule.models.items():
        spec = experiment.models[name]
        home = Layout.from_json(info["home_layout"])
        problem = layout_problem(name, archs[name], home.strategy, world_size, trained=spec.trainable,
                                 zero_stage=spec.zero_stage)
        if problem:
            return problem
    for entry in schedule.mfcs:
        problem = layout_problem(entry["model"], archs[entry["model"]], Layout.from_json(entry["layout"]).strategy,
                                 world_size)
        if problem:
            return f"{entry['name']}: {problem}"
    return None
