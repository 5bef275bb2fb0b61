"""Algorithms: each is a module with its MFC graph (``mfcs(cfg)``), losses and interface functions.

Built-in algorithms are looked up by name; an external one registers its module with
``register_algorithm(name, module)``, or a config names its module by dotted path
(``algorithm: mypkg.my_algo``). The functions a module must define are
``restage.algorithms.base.REQUIRED``; those in ``base.OPTIONAL`` default to the base behaviour
(docs/algorithms.md).
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


def is_algorithm_name(name: str) -> bool:
    """Whether a config may name this algorithm: built in, registered, or a dotted module path."""
    return name in _BUILTIN or name in _REGISTERED or "." in name


def get_algorithm(name: str):
    """The algorithm called ``name`` as a ``base.Algorithm`` (its module, optional functions defaulted)."""
    module = _REGISTERED.get(name) or _BUILTIN.get(name) or (name if "." in name else None)
    if module is None:
        raise ConfigError(f"algorithm {name!r} is unknown; use one of {', '.join(algorithm_names())}")
    if isinstance(module, str):
        try:
            module = importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"algorithm {name!r}: cannot import {module} ({err})") from None
    from restage.algorithms.base import Algorithm, check_algorithm

    if name not in _BUILTIN:
        check_algorithm(module)
    return Algorithm(module)
