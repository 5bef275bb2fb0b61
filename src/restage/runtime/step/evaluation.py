"""Evaluation during training (``run.eval_every``): the held-out prompts answered greedily and scored.

After every ``eval_every``-th step and after the last (steps count from 1), every rank walks an
evaluation program (``schedule.program.build_eval_program``) before the step's records go to the master:
the actor's generate MFC answers each held-out prompt (``dataset.eval_fraction``) greedily, and the
run's reward scores the answers: the rule reward (``reward_fn``) on the generating ranks, or the reward
model's inference MFC where the iteration runs it (the answers move there as the iteration's do).
Nothing trains and nothing is checkpointed.

The evaluation after step ``s`` evaluates policy version ``s``: the weights ``s`` train steps made, in
both execution modes (``eval_layouts``). Sync mode answers in the generate MFC's layout, reallocated from
the training layout as in the iteration. Async mode answers in the actor's training layout itself, which
holds version ``s`` once step ``s`` ends; the generation copy holds the last push's (older) version and
the batches generated ahead depend on it, so the evaluation neither reads nor replaces it, and never
touches the rollout buffer (docs/runtime.md, "Evaluation").

The held-out prompts go through in passes of ``run.batch_size`` prompts (what the plan sized the
generation's memory for); a leftover smaller than the largest data-parallel degree of the two MFCs
joins the pass before it, so every DP rank has prompts. Copies of models the passes need are made
in the first pass and dropped after the last (``pass_ops``). Every rank derives the same program
and passes from the schedule and the data set, so all meet their collectives in the same order.

Each reporting rank (tp 0, last pipeline stage, of each DP replica of the scoring MFC) sends sums
over its prompts; the master logs, at the step the evaluation follows, ``eval/reward`` (mean
reward), ``eval/accuracy`` (fraction right, where the task has a right-or-wrong test),
``eval/length`` (answer tokens, EOS included), ``eval/prompts``, ``eval/seconds`` and
``eval/policy_version`` (``master.merge_eval``). Evaluation time lies between two steps' rows, so it is not iteration time.

A multi-turn job (``environment.name``) plays one greedy episode per held-out prompt through its environment and
tools (``multi_turn.eval_episodes``); ``eval/reward`` is the episodes' reward, ``eval/length`` the tokens the policy
wrote, ``eval/accuracy`` the task's test of the final answer (after the last observation), and it adds
``eval/turns``, ``eval/tool_call_rate`` and ``eval/final_score`` (``episode_sums``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, assert_never

import torch

from restage.algorithms.rewards import AccuracyFn, RewardFn, decode, seq_sample_ids
from restage.algorithms.scoring import RewardPool, score
from restage.config.schema import ExperimentConfig
from restage.config.sections import RewardsConfig, RunConfig
from restage.data.batch import Batch
from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout
from restage.models.parallel import ParallelContext
from restage.runtime.control.records import StepRecord
from restage.runtime.step.execute import run_eval_generate, run_inference
from restage.runtime.step.multi_turn import EpisodeRecord, eval_episodes, final_answer
from restage.runtime.step.op_handlers import OpHandlers, StepData
from restage.runtime.store.zero3_generation import generation_module
from restage.schedule.execution import Async, Execution, Sync
from restage.schedule.ops import Ema, Free, Generate, Offload, Op, Push, Realloc, Reload, Run, SendKey, TakeBuffered
from restage.schedule.program import build_eval_program, model_homes

if TYPE_CHECKING:  # transformers is heavy to import; only the annotations name it
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class EvalPlan:
    """What every rank walks at an evaluation: the two MFCs, their ops, and the held-out positions of each pass."""

    generate: MFC
    reward: MFC | None  # the reward model's inference MFC; None: the rule reward scores on the generating ranks
    ops: tuple[Op, ...]
    passes: tuple[tuple[int, ...], ...]
    layouts: dict[str, Layout]  # where each MFC runs in the evaluation (``eval_layouts``)


def eval_due(done: int, run: RunConfig) -> bool:
    """Whether the run evaluates after its ``done``-th step: every ``eval_every``-th and the last."""
    return run.eval_every > 0 and (done % run.eval_every == 0 or done == run.steps)


def eval_mfcs(graph: DataflowGraph, cfg: ExperimentConfig) -> tuple[MFC, MFC | None]:
    """The actor's (sampling) generate MFC, and the reward model's inference MFC unless a rule reward scores."""
    generating = [m for m in graph if m.kind is MFCKind.GENERATE]
    if not generating:
        raise ConfigError(f"run.eval_every: {cfg.algorithm} has no generate MFC to answer held-out prompts; "
                          "set run.eval_every=0")
    actor = [m for m in generating if m.model == "actor"] or generating
    generate = next((m for m in actor if not m.greedy), actor[0])
    if cfg.reward_fn:
        return generate, None
    reward = next((m for m in graph if m.kind is MFCKind.INFERENCE and "rewards" in m.outputs
                   and m.inputs[:2] == generate.outputs[:2]), None)
    if reward is None:
        raise ConfigError("run.eval_every: no reward scores the actor's answers (set reward_fn or add models.reward)")
    return generate, reward


def eval_layouts(graph: DataflowGraph, layouts: dict[str, Layout], execution: Execution,
                 generate: MFC) -> dict[str, Layout]:
    """Where the evaluation's MFCs run: the iteration's layouts, but in async mode ``generate`` runs in its model's
    training layout (its home), the one place that holds the version the step made (module docstring)."""
    match execution:
        case Sync():
            return layouts
        case Async():
            return {**layouts, generate.name: model_homes(graph, layouts)[generate.model]}
        case _:
            assert_never(execution)


def eval_passes(n_prompts: int, per_pass: int, min_prompts: int) -> list[tuple[int, ...]]:
    """Held-out positions in passes of ``per_pass``; a last pass under ``min_prompts`` joins the one before."""
    if n_prompts < min_prompts:
        raise ConfigError(f"dataset.eval_fraction holds out {n_prompts} prompts, fewer than the {min_prompts} "
                          "data-parallel ranks that evaluate them; hold out more or set run.eval_every=0")
    passes = [tuple(range(start, min(start + per_pass, n_prompts))) for start in range(0, n_prompts, per_pass)]
    if len(passes) > 1 and len(passes[-1]) < min_prompts:
        passes[-2:] = [passes[-2] + passes[-1]]
    return passes


def plan_eval(graph: DataflowGraph, layouts: dict[str, Layout], cfg: ExperimentConfig, n_prompts: int,
              offload_idle: frozenset[str] = frozenset(), *, execution: Execution,
              resident: frozenset[str] = frozenset()) -> EvalPlan | None:
    """The run's evaluation, or None when ``run.eval_every`` is 0. ``resident``: the models whose copies stay
    between passes (LoRA models: a copy keeps its base, ``ModelEntry.arch.lora``)."""
    if cfg.run.eval_every == 0:
        return None
    generate, reward = eval_mfcs(graph, cfg)
    where = eval_layouts(graph, layouts, execution, generate)
    names = (generate.name,) + ((reward.name,) if reward is not None else ())
    min_prompts = max(where[name].strategy.dp for name in names)
    passes = eval_passes(n_prompts, max(cfg.run.batch_size, min_prompts), min_prompts)
    return EvalPlan(generate, reward, tuple(build_eval_program(graph, where, names, offload_idle, resident)),
                    tuple(passes), where)


def pass_ops(plan: EvalPlan, index: int) -> list[Op]:
    """The ops of pass ``index``: copies are made (realloc, reload) in the first pass only and dropped (free,
    offload) after the last only. Every rank of such an op skips it alike, so collectives still match."""
    first, last = index == 0, index == len(plan.passes) - 1
    return [op for op in plan.ops if _in_pass(op, first, last)]


def _in_pass(op: Op, first: bool, last: bool) -> bool:
    match op:
        case Realloc() | Reload():
            return first
        case Free() | Offload():
            return last
        case Run() | SendKey() | Ema():
            return True
        case Push() | Generate() | TakeBuffered():  # async mode's iteration ops: build_eval_program makes none
            raise AssertionError(f"{op.kind} op in an evaluation program")
        case _:
            assert_never(op)


def run_eval(handlers: OpHandlers, op: Run, data: StepData, record: StepRecord, plan: EvalPlan,
             tokenizer: PreTrainedTokenizerBase, accuracy_fn: AccuracyFn | None) -> None:
    """One ``run`` op of an evaluation pass: answer (or score) this rank's prompts; reporting ranks add their sums.

    ``handlers`` are the evaluation's: their layouts and router are ``plan.layouts``' (``Worker``)."""
    mfc = handlers.graph[op.mfc]
    assert handlers.layouts == plan.layouts, "the evaluation's handlers route by the evaluation's layouts"
    layout = handlers.layouts[mfc.name]
    slot = handlers.store.slots[mfc.model]
    module = slot.at(layout)
    ctx = ParallelContext.from_layout(layout, handlers.groups, handlers.rank)
    batch = handlers.input_batch(mfc, layout, ctx.coord.dp, data)
    ids_key, mask_key = plan.generate.outputs[:2]
    reporter = ctx.coord.tp == 0 and ctx.coord.pp == ctx.strategy.pp - 1  # one per DP replica
    rewards = None
    if mfc.kind is MFCKind.GENERATE and handlers.cfg.environment.name:
        with generation_module(module, layout, handlers.groups) as generating:
            records = eval_episodes(generating, mfc, batch, handlers.cfg, handlers.state, handlers.context)
        if reporter:
            _add(record.eval_sums, episode_sums(records, tokenizer, accuracy_fn))
        return
    if mfc.kind is MFCKind.GENERATE:
        with generation_module(module, layout, handlers.groups) as generating:  # ZeRO-3: gathered once, or lockstep
            answered = data.outputs[mfc.name] = run_eval_generate(generating, mfc, batch, handlers.cfg)
    else:  # the reward model: its input holds the answers
        answered = batch
        agree = slot.sharded.group if slot.sharded is not None else None  # its dp ranks gather in step
        scored = run_inference(module, mfc, batch, handlers.algo, handlers.cfg, handlers.state, agree).batch
        assert scored is not None  # run_inference always returns its batch
        rewards = scored["rewards"]
    scoring = (plan.reward or plan.generate).name == mfc.name
    if scoring and reporter:
        correct = None
        if rewards is None:
            reward_fn = handlers.state.reward_fn
            assert reward_fn is not None  # no reward model: the config names a reward_fn (check_reward_source)
            rewards, correct = rule_scores(answered, reward_fn, accuracy_fn, tokenizer, ids_key, mask_key,
                                           handlers.context.sample_fields, handlers.cfg.rewards,
                                           handlers.context.scoring.pool if handlers.context.scoring else None)
        _add(record.eval_sums, score_sums(answered, mask_key, rewards, correct))


def _add(sums: dict[str, float], more: Mapping[str, float]) -> None:
    for key, value in more.items():
        sums[key] = sums.get(key, 0.0) + value


def episode_sums(records: Sequence[EpisodeRecord], tokenizer: PreTrainedTokenizerBase,
                 accuracy_fn: AccuracyFn | None) -> dict[str, float]:
    """Sums over one rank's held-out episodes (``environment.name``): their rewards (the environment's, shaping
    included), the tokens the policy wrote, turns, the share with a tool call that ran, the reward_fn's score of the
    final answer (``tool_use``) and, where the task has a right-or-wrong test, whether the final answer is right."""
    sums = {"reward": sum(r.reward for r in records), "length": float(sum(sum(r.policy) for r in records)),
            "prompts": float(len(records)), "turns": float(sum(r.turns for r in records)),
            "tool_call_rate": float(sum(r.ok_calls > 0 for r in records))}
    if any(r.final_score is not None for r in records):
        sums["final_score"] = sum(r.final_score or 0.0 for r in records)
    if accuracy_fn is not None:
        prompts = [str(tokenizer.decode(list(r.ids[:r.prompt_len]), skip_special_tokens=True)) for r in records]
        finals = [str(tokenizer.decode(list(final_answer(r)), skip_special_tokens=True)) for r in records]
        sums["accuracy"] = float(sum(bool(v) for v in accuracy_fn(prompts, finals)))
    return sums


def answer_tokens(batch: Batch, mask_key: str) -> torch.Tensor:
    """``[n_seqs]`` answer tokens of each sequence (those outside the prompt mask)."""
    answer = (~batch[mask_key].bool()).long()
    return torch.zeros(batch.n_seqs, dtype=torch.long).index_add_(
        0, torch.repeat_interleave(torch.arange(batch.n_seqs), torch.tensor(batch.seqlens)), answer)


def rule_scores(batch: Batch, reward_fn: RewardFn, accuracy_fn: AccuracyFn | None, tokenizer: PreTrainedTokenizerBase,
                ids_key: str, mask_key: str, fields_of: Mapping[int, Mapping[str, Any]] | None = None,
                options: RewardsConfig | None = None, pool: RewardPool | None = None
                ) -> tuple[torch.Tensor, list[bool] | None]:
    """Rewards of generated answers under the rule reward (given each sample's dataset fields, ``fields_of``),
    and which are right where the task says (a right-or-wrong verifier's: those scoring 1). Scored on ``pool``
    (the run's: its worker processes, under a time limit, are started once) or on a pool made for the call."""
    prompts, answers = decode(batch, tokenizer, ids_key, mask_key)
    options = options or RewardsConfig()
    ids = seq_sample_ids(batch)
    values = (pool.submit(reward_fn, prompts, answers, ids, fields_of, options).result() if pool is not None
              else score(reward_fn, prompts, answers, ids, fields_of, options))
    rewards = torch.tensor(values, dtype=torch.float32)
    if accuracy_fn is None and getattr(reward_fn, "right_or_wrong", False):
        return rewards, [bool(v == 1.0) for v in rewards.tolist()]
    return rewards, (None if accuracy_fn is None else [bool(v) for v in accuracy_fn(prompts, answers)])


def score_sums(batch: Batch, mask_key: str, rewards: torch.Tensor, correct: list[bool] | None) -> dict[str, float]:
    """Sums over one rank's held-out prompts, which the master turns into means (``master.merge_eval``)."""
    sums = {"reward": float(rewards.float().sum()), "length": float(answer_tokens(batch, mask_key).sum()),
            "prompts": float(batch.n_seqs)}
    if correct is not None:
        sums["accuracy"] = float(sum(correct))
    return sums
