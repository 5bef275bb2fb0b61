"""The typed interface between an algorithm module and the runtime: ``Algorithm``, ``get_algorithm``, ``build_graph``
(and ``unused_models``: the configured models its graph does not run).

An algorithm is a module of functions (docs/algorithms.md). ``get_algorithm`` imports it and
returns an ``Algorithm``: a frozen bundle with one field per protocol function, the optional
ones filled with the defaults in ``restage.algorithms.base``. Callers see every function the
runtime may call as a typed field; nothing is looked up by name after loading.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from restage.algorithms import algorithm_module, algorithm_names, base
from restage.algorithms._graphs import ACTOR_PROX, is_async
from restage.algorithms.episode_sizes import episode_mfcs
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph

REQUIRED = ("mfcs", "validate", "forward_outputs", "loss")
OPTIONAL = ("init_state", "inference", "after_generate", "prepare_train")  # the defaults below when left out

MfcsFn = Callable[[ExperimentConfig], list[MFC]]
ValidateFn = Callable[[ExperimentConfig], Any]
ForwardOutputsFn = Callable[[str, ExperimentConfig], tuple[str, ...]]
# loss and after_generate are handed the runtime's per-call context last (base.CallContext)
LossFn = Callable[[str, Batch, dict, ExperimentConfig, base.AlgoState, base.CallContext], tuple[torch.Tensor, dict]]
InitStateFn = Callable[..., base.AlgoState]  # (cfg, tokenizer=None)
InferenceFn = Callable[[str, Batch, dict, ExperimentConfig, base.AlgoState], dict]
AfterGenerateFn = Callable[[str, Batch, ExperimentConfig, base.AlgoState, base.CallContext], Batch]
PrepareTrainFn = Callable[..., tuple[Batch, dict]]  # (batch, cfg, state, step=0, reduce=None)


@dataclass(frozen=True)
class Algorithm:
    """An algorithm's functions; ``module`` is the module they came from."""

    module: ModuleType
    mfcs: MfcsFn
    validate: ValidateFn
    forward_outputs: ForwardOutputsFn
    loss: LossFn
    init_state: InitStateFn
    inference: InferenceFn
    after_generate: AfterGenerateFn
    prepare_train: PrepareTrainFn

    @property
    def __name__(self) -> str:
        return self.module.__name__

    @classmethod
    def from_module(cls, module: ModuleType) -> Algorithm:
        """Bundle a module's functions; a module's own optional function always wins over the default."""
        check_algorithm(module)

        def default_init_state(cfg: ExperimentConfig, tokenizer=None) -> base.AlgoState:
            return base.AlgoState(cfg, build_graph(cfg), module.validate(cfg), tokenizer)

        def default_inference(mfc_name: str, batch: Batch, outputs: dict, cfg: ExperimentConfig,
                              state: base.AlgoState) -> dict:
            return base.default_inference(state.graph[mfc_name], batch, outputs)

        def default_after_generate(mfc_name: str, batch: Batch, cfg: ExperimentConfig, state: base.AlgoState,
                                   ctx: base.CallContext = base.CallContext()) -> Batch:
            return base.default_after_generate(mfc_name, batch, state, ctx)

        def default_prepare_train(batch: Batch, cfg: ExperimentConfig, state: base.AlgoState, step: int = 0,
                                  reduce=None) -> tuple[Batch, dict]:
            return batch, {}

        return cls(
            module=module, mfcs=module.mfcs, validate=module.validate, forward_outputs=module.forward_outputs,
            loss=module.loss, init_state=getattr(module, "init_state", default_init_state),
            inference=getattr(module, "inference", default_inference),
            after_generate=getattr(module, "after_generate", default_after_generate),
            prepare_train=getattr(module, "prepare_train", default_prepare_train),
        )


def check_algorithm(module: ModuleType | Algorithm) -> None:
    """Refuse a module that lacks a required protocol function (built-in and registered modules alike)."""
    if isinstance(module, Algorithm):
        module = module.module
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        raise ConfigError(f"algorithm module {module.__name__} lacks {', '.join(missing)} (see docs/algorithms.md)")


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name`` (built in, registered, or a dotted module path)."""
    module = algorithm_module(name)
    if module is None:
        raise ConfigError(f"algorithm {name!r} is unknown; use one of {', '.join(algorithm_names())}")
    if isinstance(module, str):
        try:
            module = importlib.import_module(module)
        except ImportError as err:
            raise ConfigError(f"algorithm {name!r}: cannot import {module} ({err})") from None
    return Algorithm.from_module(module)


def build_graph(cfg: ExperimentConfig) -> DataflowGraph:
    """The dataflow graph of the config's algorithm, sized by its batch and sequence lengths (the one place it is built)."""
    algorithm = get_algorithm(cfg.algorithm)
    graph = DataflowGraph(tuple(episode_mfcs(cfg, algorithm.mfcs(cfg))))  # multi-turn episodes' sizes
    if is_async(cfg) and ACTOR_PROX not in {m.name for m in graph}:
        raise ConfigError(f"{cfg.algorithm} has no asynchronous mode (its graph has no {ACTOR_PROX}; policy-gradient "
                          "algorithms add it with base.with_proximal): set plan.execution=sync")
    missing = sorted({m.model for m in graph if m.model not in cfg.models})
    if missing == ["ref"] and _kl_coef(algorithm, cfg) is not None:
        params = algorithm.validate(cfg)
        why, off = ((f"algo.kl_coef is {params.kl_coef}", "algo.kl_coef=0") if params.kl_coef > 0
                    else (f"algo.ref_ema_eta is {params.ref_ema_eta}", "algo.ref_ema_eta=0"))
        raise ConfigError(f"{cfg.algorithm} needs a reference model ({why}): add models.ref (e.g. models.ref.path: "
                          f"the actor's starting checkpoint) or set {off} to train without one")
    if missing:
        raise ConfigError(f"algorithm {cfg.algorithm} needs models {missing}; add them under models:")
    return graph


def _kl_coef(algorithm: Algorithm, cfg: ExperimentConfig) -> float | None:
    """The configured KL coefficient of an algorithm whose params have one (PPO, GRPO, ReMax), else None."""
    params_class = getattr(algorithm.module, "Params", None)
    if params_class is None or "kl_coef" not in {f.name for f in dataclasses.fields(params_class)}:
        return None
    return float(cfg.algo.get("kl_coef", params_class.kl_coef))


def unused_models(cfg: ExperimentConfig, graph: DataflowGraph) -> dict[str, str]:
    """The configured models no MFC of ``graph`` runs on, each with why; the planner and the runtime leave them out.

    A ``models.ref`` beside a KL coefficient of 0 is one (docs/algorithms.md, "Running without a reference model")."""
    algorithm = get_algorithm(cfg.algorithm)
    used = set(graph.models())
    out = {}
    for name in cfg.models:
        if name in used:
            continue
        if name == "ref" and _kl_coef(algorithm, cfg) == 0:
            out[name] = f"algo.kl_coef is 0, so {cfg.algorithm} computes no KL to a reference model"
        else:
            out[name] = f"{cfg.algorithm} runs no MFC on it with this config"
    return out
