"""Generation's entry point: ``generate(module, prompts, params)`` under any dp/tp/pp/ep layout.

The work is done by the rollout engine (``engine.py``: cache slots, continuous batching, one
prefill per prompt group), under pp by micro-groups of slots in flight through the stages
(``pipelined.py``), and the sampler (``sampling.py``: filters and per-request noise). The
last stage gathers only the decoded positions' logits over TP (``[B, V]``), picks the next tokens,
and broadcasts them (with their log-probabilities) to every stage, so all ranks of a data-parallel
replica return the same GenerationOutput.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from restage.errors import ConfigError
from restage.models.decoder import StageModule
from restage.rollout.budget import RolloutLimits
from restage.rollout.engine import RolloutEngine
from restage.rollout.pipelined import run_pipelined
from restage.rollout.sampling import SamplingParams, request_keys, request_seed


@dataclass(frozen=True)
class GenerationOutput:
    """Generated tokens per request; positions past ``lengths[b]`` hold the pad token and logprob 0."""

    tokens: torch.Tensor  # [R, max_new_tokens] int64
    logprobs: torch.Tensor  # [R, max_new_tokens] float32: log p(token) under softmax(logits / temperature)
    lengths: torch.Tensor  # [R] int64, generated tokens including a final EOS

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]

    def token_logprobs(self) -> list[list[float]]:
        return [row[:n].tolist() for row, n in zip(self.logprobs, self.lengths.tolist())]


@torch.no_grad()
def generate(module: StageModule, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), *,
             group_size: int = 1, seeds: Sequence[int] | None = None, max_new_tokens: Sequence[int] | None = None,
             limits: RolloutLimits | None = None) -> GenerationOutput:
    """Continue every prompt ``group_size`` times; all ranks of the model's replica call it with the same arguments.

    Request ``r = i * group_size + j`` is sample ``j`` of prompt ``i`` (row ``r`` of the output); a
    group's prompt is prefilled once. ``seeds[r]`` (default ``request_seed(params.seed, r)``) alone
    decides request r's random choices, whatever else is in the batch; ``max_new_tokens[r]``
    (at most ``params.max_new_tokens``, the output's width) caps its answer. ``limits`` default to
    the params' ``kv_cache_gib`` and ``max_slots``.

    Under ep every replica of an ep group must call it, with its own prompts or none: the replicas
    step in lockstep (their sparse layers exchange tokens) until all of them are done.
    """
    cfg = module.cfg
    requests = len(prompts) * group_size
    if group_size < 1 or any(len(p) == 0 for p in prompts):
        raise ConfigError(f"generate needs group_size >= 1 (got {group_size}) and prompts of at least one token")
    caps = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * requests
    seeds = list(seeds) if seeds is not None else [request_seed(params.seed, r) for r in range(requests)]
    if len(caps) != requests or len(seeds) != requests or not all(1 <= c <= params.max_new_tokens for c in caps):
        raise ConfigError(f"give one seed and one max_new_tokens in 1..{params.max_new_tokens} per request "
                          f"({requests} = prompts x group_size)")
    longest = max((len(p) for p in prompts), default=0)
    if prompts and longest + params.max_new_tokens > cfg.max_positions:
        raise ConfigError(f"prompt of {longest} tokens + max_new_tokens={params.max_new_tokens} exceeds the model's "
                          f"{cfg.max_positions} positions; shorten the prompts or max_new_tokens")
    eos_ids = list(params.eos_token_ids if params.eos_token_ids is not None else cfg.stop_token_ids)
    if limits is None:
        limits = RolloutLimits.of_params(params)
    prompt_of = [r // group_size for r in range(requests)]
    engine = RolloutEngine(module, prompts, prompt_of, caps, request_keys(seeds), params, eos_ids, limits)
    tokens, logprobs, lengths = run_pipelined(engine) if engine.num_groups > 1 else engine.run()
    width = params.max_new_tokens
    if tokens.shape[1] < width:  # every request capped below the run's max_new_tokens
        pad = torch.full((requests, width - tokens.shape[1]), params.pad_token_id, dtype=torch.int64,
                         device=tokens.device)
        tokens, logprobs = torch.cat([tokens, pad], 1), torch.cat([logprobs, torch.zeros_like(pad, dtype=torch.float32)], 1)
    return GenerationOutput(tokens, logprobs, lengths)


@dataclass(frozen=True)
class PartialRequest:
    """One request of ``continue_generate``: its prompt, its noise seed, and the answer chosen so far (empty: fresh)."""

    prompt: tuple[int, ...]
    seed: int
    answer: tuple[int, ...] = ()
    answer_logprobs: tuple[float, ...] = ()


@dataclass(frozen=True)
class PartialOutput:
    """``GenerationOutput``'s tensors (each answer whole: the part given plus the new tokens) and which requests
    finished (EOS or ``max_new_tokens``); an unfinished request's row holds its answer so far."""

    output: GenerationOutput
    finished: tuple[bool, ...]


@torch.no_grad()
def continue_generate(module: StageModule, requests: Sequence[PartialRequest], params: SamplingParams,
                      must_finish: int, limits: RolloutLimits | None = None) -> PartialOutput:
    """Partial rollouts: finish requests ``0 .. must_finish - 1`` and start or continue the later ones in the slots
    the first free, stopping at the first check where the first are all done (``RolloutEngine``'s ``must_finish``).

    A request with an answer so far is prefilled as prompt + answer (its keys and values recomputed under these
    weights) and decodes on from that answer position with its own seed, so under unchanged weights it chooses
    the tokens an uninterrupted ``generate`` would. Requests with the same prompt and no answer share its
    prefill. Every rank of the replica calls it with the same arguments; pipeline stages step one after another
    (``pp_groups=1``: a pipelined rollout cannot stop with micro-groups in flight). Under ep every replica of an ep
    group calls it, with requests of its own or none, ``must_finish`` 0 included (no slots: it only joins its
    peers' steps until they are done).
    """
    cfg = module.cfg
    if not 0 <= must_finish <= len(requests):
        raise ConfigError(f"continue_generate: must_finish={must_finish} must be in 0..{len(requests)}")
    width = params.max_new_tokens
    if any(len(r.answer) >= width or len(r.answer) != len(r.answer_logprobs) or not r.prompt for r in requests):
        raise ConfigError(f"continue_generate: every request needs a prompt and fewer than max_new_tokens={width} "
                          "answer tokens so far, each with its log-prob")
    longest = max((len(r.prompt) for r in requests), default=0)
    if longest + width > cfg.max_positions:
        raise ConfigError(f"prompt of {longest} tokens + max_new_tokens={width} exceeds the model's "
                          f"{cfg.max_positions} positions; shorten the prompts or max_new_tokens")
    prompts: list[tuple[int, ...]] = []
    index: dict[tuple[int, ...], int] = {}  # fresh prompts share one entry (and one prefill)
    prompt_of = []
    for r in requests:
        if r.answer:
            prompts.append(r.prompt + r.answer)
            prompt_of.append(len(prompts) - 1)
        else:
            if r.prompt not in index:
                index[r.prompt] = len(prompts)
                prompts.append(r.prompt)
            prompt_of.append(index[r.prompt])
    eos_ids = list(params.eos_token_ids if params.eos_token_ids is not None else cfg.stop_token_ids)
    limits = dataclasses.replace(limits or RolloutLimits.of_params(params), pp_groups=1)
    started = [len(r.answer) for r in requests]
    engine = RolloutEngine(module, prompts, prompt_of, [width] * len(requests), request_keys([r.seed for r in requests]),
                           params, eos_ids, limits, started=started, must_finish=must_finish)
    for row, r in enumerate(requests):
        if r.answer:
            engine.tokens[row, :len(r.answer)] = torch.tensor(r.answer, dtype=torch.int64).to(engine.device)
            engine.logprobs[row, :len(r.answer)] = torch.tensor(r.answer_logprobs, dtype=torch.float32).to(engine.device)
    tokens, logprobs, lengths = engine.run()
    open_ = set(engine.unfinished())
    return PartialOutput(GenerationOutput(tokens, logprobs, lengths),
                         tuple(row not in open_ for row in range(len(requests))))
