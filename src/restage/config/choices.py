"""The closed choices of an experiment config: one enum or ``Literal`` each, and the check that makes a refusal's
one-line error from the allowed values (the config reader's and ``ExperimentConfig``'s)."""

from __future__ import annotations

import typing
from enum import Enum, StrEnum
from typing import Any, Literal

from restage.errors import ConfigError

# The closed choices of a config. Each set of allowed values is written once, here: ``check_choice`` (the config
# reader's and ``ExperimentConfig``'s check) makes the error from it. The choices code dispatches on are enums
# (``match`` on the members); the rest are ``Literal``s. StrEnums keep the plain names in YAML, JSON and logs.


class DatasetKind(StrEnum):
    """``dataset.kind``: what a row holds."""

    PROMPT = "prompt"
    SFT = "sft"
    PREFERENCE = "preference"


class Execution(StrEnum):
    """``plan.execution``: sync (generate, then train, every step), async (generation runs ahead of training) or
    auto (the planner predicts both and runs the faster)."""

    SYNC = "sync"
    ASYNC = "async"
    AUTO = "auto"


class PlanMode(StrEnum):
    """``plan.mode``: how the layouts are chosen."""

    SEARCH = "search"
    HEURISTIC = "heuristic"
    MANUAL = "manual"


Dtype = Literal["fp32", "bf16", "fp16"]
DTYPES: tuple[Dtype, ...] = typing.get_args(Dtype)
AUTO_DTYPE: Literal["auto"] = "auto"  # bf16 on a GPU cluster, fp32 on a CPU one (resolved when the config is built)
DtypeSetting = Literal[Dtype, "auto"]  # models.<name>.dtype as written; "auto" is resolved when the config is built
ZeroStage = Literal[0, 1, 2, 3]  # models.<name>.zero_stage
LrSchedule = Literal["constant", "linear", "cosine"]
KvCacheLayout = Literal["auto", "paged", "contiguous"]  # generation.kv_cache
KV_CACHE_LAYOUTS: tuple[KvCacheLayout, ...] = typing.get_args(KvCacheLayout)
OnRewardError = Literal["zero", "stop"]  # rewards.on_error
OnRewardTimeout = Literal["score", "stop"]  # rewards.on_timeout
WandbMode = Literal["off", "offline", "online"]  # dashboards.wandb
OnNonfinite = Literal["skip", "stop"]  # run.nonfinite
ShardFrozenChoice = Literal["off", "auto"]  # plan.shard_frozen
LauncherSetting = Literal["auto", "srun", "mpirun"]  # slurm.launcher


def allowed_values(tp: object) -> tuple[str | int, ...] | None:
    """The values a ``Literal`` or enum annotation allows (in the order written); None for any other annotation."""
    if isinstance(tp, type) and issubclass(tp, Enum):
        return tuple(member.value for member in tp)
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def check_choice(value: object, tp: object, key: str) -> Any:
    """``value`` if ``tp`` (a ``Literal`` or an enum) allows it, an enum's member for its name; else a one-line
    ConfigError made from the allowed values."""
    allowed = allowed_values(tp)
    assert allowed is not None, f"{key}: {tp} is not a closed choice"
    if isinstance(value, (str, int)) and not isinstance(value, bool) and value in allowed:
        return tp(value) if isinstance(tp, type) else value
    raise ConfigError(f"{key}: {value!r} must be one of {', '.join(str(v) for v in allowed)}")
