"""The checks ``restage run`` and ``restage submit`` share, made before anything starts or is queued.

``job_overrides``: a config written for one cluster and started on another (an override of ``cluster.name``)
takes the new cluster's devices per node from its cluster file, unless the overrides set
``cluster.devices_per_node`` too; the file's value was for its own cluster, and the change is said in one line.
``validate``: the model directories, the algorithm's own rules, the data set against the models' positions,
then the plan (layouts, memory; ``plan.planner.make_plan``). A config that fails any of them is refused in one
line naming what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from restage.config.load import load_config
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError


def _override_keys(overrides: Sequence[str]) -> set[str]:
    return {o.split("=", 1)[0].strip() for o in overrides if "=" in o}


def job_overrides(config: str | Path, overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the overrides to load ``config`` with, notes to print): ``cluster.devices_per_node=0`` is added when the
    overrides move the job to another cluster file and leave its devices per node as the config file set them."""
    keys = _override_keys(overrides)
    if "cluster.name" not in keys or "cluster.devices_per_node" in keys:
        return list(overrides), []
    try:
        written = (yaml.safe_load(Path(config).read_text()) or {}).get("cluster") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        return list(overrides), []  # load_config says what is wrong with the file
    if not isinstance(written, dict) or not written.get("devices_per_node"):
        return list(overrides), []
    cfg = load_config(config, list(overrides))
    if cfg.cluster.name == written.get("name", ""):
        return list(overrides), []
    from restage.cluster import load_cluster

    spec = load_cluster(cfg.cluster.name, cfg.cluster.nodes)
    note = (f"restage: note: cluster.devices_per_node: {written['devices_per_node']} in {config} was written for "
            f"cluster {written.get('name') or '(the default)'}; cluster.name={cfg.cluster.name} has "
            f"{spec.devices_per_node} per node (its cluster file), which the job uses: set "
            f"cluster.devices_per_node={written['devices_per_node']} to keep the file's")
    return [*overrides, "cluster.devices_per_node=0"], [note]


def load_job_config(config: str | Path, overrides: Sequence[str]) -> tuple[ExperimentConfig, list[str], list[str]]:
    """(config, the overrides it was loaded with, notes): ``load_config`` after ``job_overrides``."""
    effective, notes = job_overrides(config, overrides)
    return load_config(config, effective), effective, notes


def check_inputs(cfg: ExperimentConfig) -> None:
    """One-line refusals for inputs that would otherwise fail inside the ranks: model directories, the
    algorithm's rules, the data set (read and tokenised) against the models' positions."""
    from restage.algorithms.interface import get_algorithm
    from restage.data.datasets import check_positions, load_splits
    from restage.models.arch import ModelConfig

    positions = {}
    for name, spec in cfg.models.items():
        if not spec.path:
            raise ConfigError(f"models.{name}.path: a checkpoint directory is needed to run (arch alone only plans)")
        positions[name] = ModelConfig.from_pretrained(spec.path).max_positions
    get_algorithm(cfg.algorithm).validate(cfg)
    train, held_out = load_splits(cfg)
    if cfg.run.batch_size > len(train):
        raise ConfigError(f"run.batch_size {cfg.run.batch_size} exceeds the {len(train)} training examples of "
                          f"{cfg.dataset.path}")
    check_positions(cfg, (train, held_out), positions)


def plan_job(cfg: ExperimentConfig):
    """The schedule of ``cfg`` on its cluster: the planner refuses layouts that do not fit the ranks or memory."""
    from restage.plan.planner import make_plan
    from restage.plan.schedule import build_schedule

    return build_schedule(cfg, make_plan(cfg, with_baselines=False))


def validate(cfg: ExperimentConfig, *, plan: bool = True):
    """Everything ``restage run`` checks before its ranks start, for ``restage submit`` before it queues: the
    inputs, then (``plan``) the plan; returns the schedule (None when not planned)."""
    check_inputs(cfg)
    return plan_job(cfg) if plan else None
