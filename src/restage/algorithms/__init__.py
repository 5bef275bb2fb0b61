"""Algorithms: each is a module with its MFC graph (``mfcs(cfg)``), losses and interface functions.

Built-in algorithms are looked up by name; an external one registers its module with
``register_algorithm(name, module)``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from restage.errors import ConfigError

_BUILTIN = {
    "sft": "restage.algorithms.sft",
    "rm": "restage.algorithms.rm",
    "dpo": "restage.algorithms.dpo",
    "ppo": "restage.algorithms.ppo",
    "grpo": "restage.algorithms.grpo",
    "remax": "restage.algorithms.remax",
    "raft": "restage.algorithms.raft",
}
_REGISTERED: dict[str, ModuleType | str] = {}


def register_algorithm(name: str, module: ModuleType | str) -> None:
    """Make ``module`` (or its dotted name) the algorithm called ``name``."""
    _REGISTERED[name] = module


def algorithm_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*_BUILTIN, *_REGISTERED]))


def get_algorithm(name: str) -> ModuleType:
    module = _REGISTERED.get(name) or _BUILTIN.get(name)
    if module is None:
        raise ConfigError(f"algorithm {name!r} is unknown; use one of {', '.join(algorithm_names())}")
    return importlib.import_module(module) if isinstance(module, str) else module
