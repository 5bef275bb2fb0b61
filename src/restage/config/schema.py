"""Experiment config schema: the config and its validation with clear errors (its sections: ``sections.py``; its
closed choices: ``choices.py``; loading: ``load.py``).

A config is plain frozen data. Each section is a dataclass; unknown keys and wrong types are
refused with the dotted key that is wrong and what it should be. Algorithm-specific
hyper-parameters live in the free-form ``algo`` mapping, which the algorithm validates.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from restage.algorithms import algorithm_names, is_algorithm_name
from restage.cluster import load_cluster
from restage.config.choices import (
    AUTO_DTYPE,
    DatasetKind,
    Dtype,
    Execution,
    allowed_values,
    check_choice,
)
from restage.config.sections import (
    LORA_ALL_LINEAR,
    LORA_HF_NAMES,
    LORA_MODULES,
    ClusterRef,
    DashboardsConfig,
    DatasetConfig,
    EnvironmentConfig,
    GenerationConfig,
    ModelSpec,
    PlanConfig,
    RewardsConfig,
    RunConfig,
    SlurmConfig,
)
from restage.errors import ConfigError

# What ``restage.config.schema`` has always offered: the config, its sections, its choices and ConfigError.

@dataclass(frozen=True)
class ExperimentConfig:
    experiment: str
    algorithm: str
    models: dict[str, ModelSpec]
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    trial: str = "default"
    seed: int = 1
    algo: dict[str, Any] = field(default_factory=dict)
    reward_fn: str = ""  # "module:function" rule-based reward instead of a reward model
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    dashboards: DashboardsConfig = field(default_factory=DashboardsConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    cluster: ClusterRef = field(default_factory=ClusterRef)
    plan: PlanConfig = field(default_factory=PlanConfig)
    run: RunConfig = field(default_factory=RunConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        if not is_algorithm_name(self.algorithm):
            raise ConfigError(f"algorithm: {self.algorithm!r} is unknown; use one of {', '.join(algorithm_names())}")
        if not self.models:
            raise ConfigError("models: at least one model is needed (e.g. models.actor.path)")
        _check_choices(self, "")
        for name, spec in self.models.items():
            if not spec.path and not spec.arch:
                raise ConfigError(f"models.{name}: give path (a HF model directory) or arch (a preset such as llama-7b)")
            if spec.router_aux_loss_coef is not None and not spec.router_aux_loss_coef >= 0:
                raise ConfigError(f"models.{name}.router_aux_loss_coef: {spec.router_aux_loss_coef} must be >= 0 "
                                  "(or left out for the checkpoint's config.json value)")
            if spec.shard_frozen and (spec.trainable or spec.offload_when_idle or spec.lora is not None):
                why = "trainable" if spec.trainable else "offload_when_idle" if spec.offload_when_idle else "lora"
                raise ConfigError(f"models.{name}.shard_frozen: a sharded frozen model runs only inference on its home "
                                  f"layout, but models.{name}.{why} is set; set models.{name}.shard_frozen false")
        self._resolve_auto_dtypes()
        if self.run.steps < 1 or self.run.batch_size < 1 or self.run.micro_batches < 1:
            raise ConfigError("run.steps, run.batch_size and run.micro_batches must be >= 1")
        self._check_values()
        if self.run.max_skipped_steps < 1:
            raise ConfigError(f"run.max_skipped_steps: {self.run.max_skipped_steps} must be >= 1")
        if self.plan.staleness < 1:
            raise ConfigError(f"plan.staleness: {self.plan.staleness} must be >= 1 (policy versions a trained token "
                              "may lag behind the weights being trained)")
        if not 1 <= self.plan.push_every <= self.plan.staleness:
            raise ConfigError(f"plan.push_every: {self.plan.push_every} must be between 1 and plan.staleness="
                              f"{self.plan.staleness} (weights older than the bound would generate)")
        if self.plan.partial_rollouts:
            _check_partial_rollouts(self.plan)

    def _check_values(self) -> None:
        """Values whose validity needs no rank: refused here, in one line, before anything starts."""
        for name, spec in self.models.items():
            optim = spec.optim
            if spec.trainable and not optim.lr > 0:
                raise ConfigError(f"models.{name}.optim.lr: {optim.lr} must be > 0")
            if optim.grad_clip < 0 or optim.weight_decay < 0 or optim.warmup_steps < 0:
                raise ConfigError(f"models.{name}.optim: grad_clip, weight_decay and warmup_steps must be >= 0")
            if spec.lora is not None:
                _check_lora(name, spec)
        gen, run = self.generation, self.run
        if gen.max_new_tokens < 1:
            raise ConfigError(f"generation.max_new_tokens: {gen.max_new_tokens} must be >= 1")
        if not 0 <= gen.min_new_tokens <= gen.max_new_tokens:
            raise ConfigError(f"generation.min_new_tokens: {gen.min_new_tokens} must be in 0..max_new_tokens "
                              f"({gen.max_new_tokens})")
        if not gen.temperature > 0:
            raise ConfigError(f"generation.temperature: {gen.temperature} must be > 0 (for greedy decoding set "
                              "generation.greedy=true)")
        if gen.max_slots < 1 or gen.kv_cache_gib < 0:
            raise ConfigError(f"generation.max_slots ({gen.max_slots}) must be >= 1 and generation.kv_cache_gib "
                              f"({gen.kv_cache_gib}) >= 0 (0: sized from free memory)")
        if gen.kv_block_tokens < 0:
            raise ConfigError(f"generation.kv_block_tokens: {gen.kv_block_tokens} must be >= 0 (0: automatic)")
        if gen.top_k < 0 or not 0 < gen.top_p <= 1 or not 0 <= gen.min_p < 1:
            raise ConfigError("generation.top_k must be >= 0, generation.top_p in (0, 1] and generation.min_p in [0, 1)")
        if run.save_every < 0 or run.stop_at_step < 0 or run.log_every < 1:
            raise ConfigError("run.save_every and run.stop_at_step must be >= 0 (0: off), run.log_every >= 1")
        if run.save_before_end_seconds < 0:
            raise ConfigError(f"run.save_before_end_seconds: {run.save_before_end_seconds} must be >= 0 (0: automatic, "
                              "from the measured step and checkpoint times)")
        if run.nprocs < 0:
            raise ConfigError(f"run.nprocs: {run.nprocs} must be >= 0 (0: cluster.nodes x devices per node)")
        if run.threads_per_rank < 0:
            raise ConfigError(f"run.threads_per_rank: {run.threads_per_rank} must be >= 0 (0: from the rank's cores)")
        if run.eval_every < 0:
            raise ConfigError(f"run.eval_every: {run.eval_every} must be >= 0 (0: no evaluation)")
        held_out = self.dataset.eval_fraction > 0 or self.dataset.eval_split or self.dataset.eval_path
        if run.eval_every > 0 and not held_out:
            raise ConfigError(f"run.eval_every: {run.eval_every} evaluates held-out prompts, but dataset.eval_fraction "
                              "is 0; hold some out (e.g. dataset.eval_fraction=0.02, or dataset.eval_split / "
                              "dataset.eval_path) or set run.eval_every=0")
        if run.eval_every > 0 and self.dataset.kind is not DatasetKind.PROMPT:
            raise ConfigError(f"run.eval_every: evaluation generates answers to held-out prompts, but dataset.kind is "
                              f"{self.dataset.kind.value!r} ({self.algorithm} does not generate); set run.eval_every=0")
        _check_user_data(self)
        if run.keep_checkpoints < 1:
            raise ConfigError(f"run.keep_checkpoints: {run.keep_checkpoints} must be >= 1 (the newest is always kept)")
        if run.micro_batches > run.batch_size:
            raise ConfigError(f"run.micro_batches: {run.micro_batches} is more than run.batch_size "
                              f"({run.batch_size}); use at most one micro-batch per prompt")

    def _resolve_auto_dtypes(self) -> None:
        """``dtype: auto`` becomes bf16 where the cluster's devices are GPUs (flash-attn, tensor cores) and fp32 on CPUs."""
        auto = [name for name, spec in self.models.items() if spec.dtype == AUTO_DTYPE]
        if not auto:
            return
        cluster = load_cluster(self.cluster.name, self.cluster.nodes, self.cluster.devices_per_node or None)
        dtype: Dtype = "bf16" if cluster.has_gpus else "fp32"
        for name in auto:  # the mapping is this config's own (built by ``build``), frozen specs inside it
            self.models[name] = dataclasses.replace(self.models[name], dtype=dtype)

    @property
    def trial_dir(self) -> Path:
        return Path(self.run.results_dir) / self.experiment / self.trial

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _check_lora(name: str, spec: ModelSpec) -> None:
    lora, key = spec.lora, f"models.{name}.lora"
    assert lora is not None  # called for a model with a lora section
    if not spec.trainable:
        raise ConfigError(f"{key}: adapters are trained, but models.{name} is not trainable; set "
                          f"models.{name}.trainable=true or remove {key}")
    if lora.rank < 1:
        raise ConfigError(f"{key}.rank: {lora.rank} must be >= 1")
    if not lora.alpha > 0:
        raise ConfigError(f"{key}.alpha: {lora.alpha} must be > 0")
    unknown = [t for t in lora.target_modules if t not in LORA_MODULES and t not in LORA_HF_NAMES]
    if LORA_ALL_LINEAR in lora.target_modules:
        unknown = [] if len(lora.target_modules) == 1 else [t for t in lora.target_modules if t != LORA_ALL_LINEAR]
    if unknown or not lora.target_modules:
        raise ConfigError(f"{key}.target_modules: {unknown or 'an empty list'} is not a list of "
                          f"{', '.join(LORA_MODULES)} (or their HF names {', '.join(LORA_HF_NAMES)}), or "
                          f"[{LORA_ALL_LINEAR}] alone")
    if lora.dropout != 0:
        raise ConfigError(f"{key}.dropout: {lora.dropout}; LoRA dropout is not implemented, set it to 0")


def _check_user_data(cfg: ExperimentConfig) -> None:
    """The dataset's held-out choice, the rewards' and the dashboards' options."""
    ds, rewards = cfg.dataset, cfg.rewards
    if sum(bool(x) for x in (ds.eval_fraction, ds.eval_split, ds.eval_path)) > 1:
        raise ConfigError("dataset: hold out by one of eval_fraction, eval_split or eval_path, not several")
    if rewards.workers < 1:
        raise ConfigError(f"rewards.workers: {rewards.workers} must be >= 1")
    if not rewards.code_timeout_seconds > 0 or rewards.code_memory_bytes < 2**20:
        raise ConfigError("rewards.code_timeout_seconds must be > 0 and rewards.code_memory_bytes >= 1 MiB")
    if not (rewards.timeout_seconds >= 0 and rewards.batch_timeout_seconds >= 0):
        raise ConfigError("rewards.timeout_seconds and rewards.batch_timeout_seconds must be >= 0 (0: no limit)")
    if not float("-inf") < rewards.timeout_score < float("inf"):
        raise ConfigError(f"rewards.timeout_score: {rewards.timeout_score} must be a finite number")


def _check_choices(section: Any, key: str) -> None:
    """Refuse a closed choice's value that is not one of its allowed ones, for a config built in code as well as one
    read from a file; an enum's plain name becomes its member. Sections are frozen: set in place while being built."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        where, value = f"{key}.{f.name}" if key else f.name, getattr(section, f.name)
        if allowed_values(hints[f.name]) is not None:
            object.__setattr__(section, f.name, check_choice(value, hints[f.name], where))
        elif dataclasses.is_dataclass(value):
            _check_choices(value, where)
        elif isinstance(value, dict):
            for name, item in value.items():
                if dataclasses.is_dataclass(item):
                    _check_choices(item, f"{where}.{name}")


def _check_partial_rollouts(plan: PlanConfig) -> None:
    """Partial rollouts continue answers across weight pushes: asynchronous training, with room for two versions."""
    match plan.execution:
        case Execution.SYNC:
            raise ConfigError("plan.partial_rollouts: partial rollouts continue answers across weight pushes, which "
                              "only asynchronous training has; set plan.execution=async (or auto) or drop it")
        case Execution.ASYNC if plan.staleness < plan.push_every + 1:
            raise ConfigError(f"plan.partial_rollouts: needs plan.staleness >= plan.push_every + 1 (an answer spans "
                              f"two steps' weights), got staleness={plan.staleness} push_every="
                              f"{plan.push_every}; set plan.staleness={plan.push_every + 1} or "
                              "plan.partial_rollouts=false")
        case Execution.ASYNC | Execution.AUTO:
            pass
        case unknown:
            typing.assert_never(unknown)


def _to_plain(value):
    if isinstance(value, Enum):
        return value.value  # the plain name, as the config file has it
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_plain(v) for v in value]
    return value
