"""Algorithms: each is a module with its MFC graph (``mfcs(cfg)``), losses and interface functions.

This package's ``__init__`` is only the table of names (the config checks an algorithm name
against it without importing torch). ``restage.algorithms.interface.get_algorithm`` loads an
algorithm as the typed ``Algorithm`` bundle of its functions. An external algorithm registers
its module with ``register_algorithm(name, module)``, or a config names its module by dotted
path (``algorithm: mypkg.my_algo``). The functions a module must define are
``restage.algorithms.interface.REQUIRED``; those in ``OPTIONAL`` default to the base behaviour
(docs/algorithms.md).
"""

from __future__ import annotations

from types import ModuleType

BUILTIN = {
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
    return tuple(dict.fromkeys([*BUILTIN, *_REGISTERED]))


def is_algorithm_name(name: str) -> bool:
    """Whether a config may name this algorithm: built in, registered, or a dotted module path."""
    return name in BUILTIN or name in _REGISTERED or "." in name


def algorithm_module(name: str) -> ModuleType | str | None:
    """The module (or its dotted name) of the algorithm called ``name``; None when unknown."""
    return _REGISTERED.get(name) or BUILTIN.get(name) or (name if "." in name else None)
