"""The interface between an algorithm module and the runtime, and the defaults most algorithms share.

Every algorithm module defines the functions named in ``interface.REQUIRED``; those in
``interface.OPTIONAL`` it may leave to the defaults built from this module's ``default_*``
functions (docs/algorithms.md has the full contract).
In short, per iteration the runtime:

1. ``generate`` MFCs: runs the model, packs ``seqs``/``prompt_mask``/``logprobs`` into a ``Batch``,
   then calls ``after_generate(mfc_name, batch, cfg, state, ctx)`` (function rewards are added here: under the
   runtime, whose context carries its ``RewardScoring``, they are started here and attached where first sent);
2. ``inference`` MFCs: runs the forward pass that ``forward_outputs(mfc_name, cfg)`` asks for on
   each micro-batch and turns it into the MFC's output keys with ``inference(...)``;
3. once per iteration on the train ranks: ``prepare_train(batch, cfg, state, step, reduce)``;
4. ``train_step`` MFCs: for each minibatch and micro-batch, the forward pass of
   ``forward_outputs``, then ``loss(mfc_name, micro_batch, outputs, cfg, state, ctx) -> (loss, stats)``.

``state`` (``AlgoState``) is the algorithm's own: the runtime makes it with ``init_state`` and never writes it.
What the runtime knows about a call (the policy version a train step starts from, the samples' dataset fields,
its reward pool) it hands over as a frozen ``CallContext``; the default context is "not under the runtime".
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from restage.algorithms import packed_ops
from restage.algorithms._graphs import is_async, reward_source, sizes, with_proximal  # noqa: F401  (re-exported)
from restage.algorithms.rewards import as_tensor, function_rewards, resolve_reward, start_function_rewards
from restage.algorithms.scoring import PendingScores, RewardPool
from restage.config.load import build
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, MFCKind

FORWARD_OUTPUTS = ("logprobs", "entropy", "values")  # what a model forward can be asked for


def parse_params(cls, cfg: ExperimentConfig):
    """The algorithm's hyper-parameter dataclass from ``cfg.algo``; unknown keys and wrong types name the key."""
    return build(cls, dict(cfg.algo), "algo")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"algo.{name}: {value!r} must be one of {', '.join(map(str, choices))}")


def check_positive(params, *names: str, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(params, name)
        if value < 0 or (value == 0 and not allow_zero):
            raise ConfigError(f"algo.{name}: {value} must be {'>= 0' if allow_zero else '> 0'}")


def check_reward_source(cfg: ExperimentConfig) -> None:
    """A rule-based ``reward_fn`` must resolve; without one the config needs a ``reward`` model."""
    if cfg.reward_fn:
        resolve_reward(cfg.reward_fn, cfg.rewards)
    elif "reward" not in cfg.models:
        raise ConfigError(f"{cfg.algorithm} needs a reward: set reward_fn (e.g. sort) or add models.reward")


class AlgoState:
    """What an algorithm keeps between calls: parsed params, its graph, the reward function, and
    persistent objects (value normaliser, KL controller) whose ``state_dict`` goes into checkpoints.
    Only the algorithm writes it; what the runtime tells it per call comes in a ``CallContext``."""

    def __init__(self, cfg: ExperimentConfig, graph: DataflowGraph, params, tokenizer=None, **persistent):
        self.params = params
        self.graph = graph
        self.tokenizer = tokenizer
        self.reward_fn = resolve_reward(cfg.reward_fn, cfg.rewards) if cfg.reward_fn else None
        self.reward_options = cfg.rewards
        self.persistent = persistent
        self._step: int | None = None
        self._snapshot: dict | None = None

    def __getitem__(self, name: str):
        return self.persistent[name]

    def state_dict(self) -> dict:
        return {name: obj.state_dict() for name, obj in self.persistent.items()}

    def load_state_dict(self, state: dict) -> None:
        for name, obj in self.persistent.items():
            if name in state:
                obj.load_state_dict(state[name])

    def begin_step(self, step: int) -> None:
        """Make ``prepare_train`` idempotent per step: a second call for the same step starts from the same state."""
        if step == self._step and self._snapshot is not None:
            self.load_state_dict(copy.deepcopy(self._snapshot))
        else:
            self._step, self._snapshot = step, copy.deepcopy(self.state_dict())


def ids_key(mfc: MFC) -> str:
    """The key holding the token ids an inference/train MFC runs on (its first input)."""
    return mfc.inputs[0]


def mask_key(mfc: MFC) -> str:
    """The key holding its prompt mask (its second input)."""
    return mfc.inputs[1]


def answer_mask(batch: Batch, key: str = "prompt_mask") -> torch.Tensor:
    """``[T]`` bool: the answer tokens (not prompt), where losses and advantages live."""
    return ~batch[key].bool()


def _forward_for(key: str) -> str:
    if key.endswith("logprobs"):
        return "logprobs"
    if key == "values" or key.endswith("rewards"):
        return "values"
    raise ConfigError(f"no model forward produces the key {key!r}")


def default_forward_outputs(graph: DataflowGraph, mfc_name: str) -> tuple[str, ...]:
    """Forward outputs an inference MFC needs: ``logprobs`` for ``*logprobs`` keys, ``values`` for values and rewards."""
    return tuple(dict.fromkeys(_forward_for(k) for k in graph[mfc_name].outputs))


def default_inference(mfc: MFC, batch: Batch, outputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map forward outputs to the MFC's keys: ``*logprobs`` per token, ``values`` per token, ``*rewards`` = last-token value."""
    out = {}
    for key in mfc.outputs:
        if key.endswith("logprobs"):
            out[key] = outputs["logprobs"]
        elif key == "values":
            out[key] = outputs["values"]
        elif key.endswith("rewards"):
            out[key] = packed_ops.last_token(outputs["values"], batch.cu_seqlens).float()
        else:
            raise ConfigError(f"MFC {mfc.name}: no rule turns a forward pass into {key!r}")
    return out


def generated_reward_keys(mfc: MFC) -> tuple[str, str, str] | None:
    """(ids key, prompt-mask key, reward key) of a generate MFC that must attach function rewards, else None."""
    rewards = [k for k in mfc.outputs if k.endswith("rewards")]
    if mfc.kind is not MFCKind.GENERATE or not rewards:
        return None
    return mfc.outputs[0], mfc.outputs[1], rewards[0]


@dataclass(frozen=True)
class PendingRewards:
    """A generate MFC's function rewards being scored: the key they go to, and the scores to wait for."""

    key: str
    scores: PendingScores

    def attach(self, batch: Batch) -> Batch:
        """``batch`` with the rewards under ``key``, once scored (raises what the reward raised)."""
        return batch.with_keys(seqs={self.key: as_tensor(self.scores)})


class RewardScoring:
    """The runtime's scoring of function rewards behind the rank's next ops: its worker pool, and the rewards each
    generate MFC's ``after_generate`` started, held until the runtime ``take``s them. The worker makes and closes it."""

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool
        self._started: dict[str, PendingRewards] = {}  # generate MFC -> its rewards being scored

    def start(self, mfc_name: str, pending: PendingRewards) -> None:
        self._started[mfc_name] = pending

    def take(self, mfc_name: str) -> PendingRewards | None:
        """The rewards ``mfc_name``'s last ``after_generate`` started (None if it started none), handed over once."""
        return self._started.pop(mfc_name, None)


@dataclass(frozen=True)
class CallContext:
    """What the runtime tells an algorithm function about one call; made by the runtime, read (never kept) by the
    algorithm. ``CallContext()`` is a call outside the runtime (tests, tools): sync, rewards scored at once."""

    # Async mode (plan.execution: async): the version of the actor weights a train step starts from (0 before the
    # first update, +1 per actor train step); the loss measures every token's age against it
    # (``offpolicy.version_gap_stats``). None in sync mode.
    policy_version: int | None = None
    sample_fields: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)  # sample id -> dataset fields
    scoring: RewardScoring | None = None  # the runtime's: rewards start here and are attached later


def default_after_generate(mfc_name: str, batch: Batch, state: AlgoState, ctx: CallContext) -> Batch:
    """Check the group layout and attach function rewards to a generated batch when the MFC declares them.

    Under the runtime (``ctx.scoring``) the rewards are only started: the batch comes back without them and
    ``ctx.scoring.take(mfc_name)`` hands them to the runtime, which attaches them."""
    mfc = state.graph[mfc_name]
    group = mfc.options.group
    if batch.group_size != group:
        raise ValueError(f"{mfc_name}: generated batch has groups of {batch.group_size}, the MFC asks for {group}")
    keys = generated_reward_keys(mfc)
    if keys is None or keys[2] in batch:
        return batch
    if state.reward_fn is None or state.tokenizer is None:
        raise ValueError(f"{mfc_name} must attach {keys[2]!r} but the state has no reward function or tokenizer")
    if ctx.scoring is None:  # not under the runtime (tests, tools): scored here and now
        return batch.with_keys(seqs={keys[2]: function_rewards(batch, state.reward_fn, state.tokenizer, keys[0],
                                                               keys[1], ctx.sample_fields, state.reward_options)})
    ctx.scoring.start(mfc_name, PendingRewards(keys[2], start_function_rewards(
        batch, state.reward_fn, state.tokenizer, ctx.scoring.pool, keys[0], keys[1], ctx.sample_fields,
        state.reward_options)))
    return batch
