"""Reading an experiment config: YAML files, ``key=value`` overrides, and the mapping-to-dataclass builder that
refuses unknown keys and wrong types with the dotted key that is wrong (the schema: ``schema.py``)."""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from restage.config.choices import AUTO_DTYPE, allowed_values, check_choice
from restage.config.paths import resolve_file_paths, resolve_paths
from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value, tp, key: str):
    """Check (and gently coerce: int -> float, list -> tuple) ``value`` against the annotation ``tp``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if allowed_values(tp) is not None:  # a Literal or an enum: one of its values (an enum's name becomes its member)
        return check_choice(value, tp, key)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            if option is type(None):
                if value is None:
                    return None
                continue  # a value is not None: only the other options can take it
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err)
        raise errors[-1]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {_field_names(tp)}, got {value!r}")
        return build(tp, value, key)
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return {_coerce(k, key_tp, key): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {len(value)}")
            return tuple(_coerce(v, a, key) for v, a in zip(value, args))
        inner = args[0] if args else Any
        return origin(_coerce(v, inner, key) for v in value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 as a string
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # trial=3 names a trial "3"
    if tp in (int, float, str, bool):
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
    return value


def _field_names(cls) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def build(cls, data: dict, prefix: str = ""):
    """Build dataclass ``cls`` from a mapping, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{where}: unknown key; known keys here: {_field_names(cls)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        where = f"{prefix}.{f.name}" if prefix else f.name
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: missing; it is required")
    return cls(**kwargs)


def apply_override(data: dict, override: str) -> None:
    """Apply ``a.b.c=value`` (value parsed as YAML) to a nested mapping in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} is not key=value")
    dotted, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        value = raw  # YAML 1.1 reads on/off/yes/no as booleans; on the command line they are names

    node = data
    parts = dotted.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {part} is not a mapping")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read a YAML experiment config, apply overrides, validate. The file's relative paths are made absolute against
    its directory, the overrides' against the working directory (``config.paths``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path.absolute()} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}: not valid YAML{where}; fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    resolve_file_paths(data, path)
    for override in overrides:
        apply_override(data, override)
    resolve_paths(data, Path.cwd())
    return config_from_dict(data)


def config_from_dict(data: dict) -> ExperimentConfig:
    models = data.get("models")
    if isinstance(models, dict) and all(isinstance(m, dict) for m in models.values()):
        data = {**data, "models": {name: {"dtype": AUTO_DTYPE, **spec} for name, spec in models.items()}}
    return build(ExperimentConfig, data)
