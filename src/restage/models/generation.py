"""Batched generation with a KV cache, under any TP x PP layout.

Prompts are prefilled as one packed batch (no padding); each following step feeds one token per
sequence through the stages. The last stage gathers only the last position's logits over TP
(``[B, V]``), picks the next tokens, and broadcasts them (with their log-probabilities) to every
stage, so all ranks of a data-parallel replica return the same GenerationOutput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from restage.config import GenerationConfig
from restage.errors import ConfigError
from restage.models.decoder import StageModule
from restage.models.moe import MoEMLP
from restage.models.packing import PackedBatch, pack
from restage.models.parallel import gather_from_tp, vocab_sizes
from restage.models.pipeline import recv_tensor, send_tensor


@dataclass(frozen=True)
class SamplingParams(GenerationConfig):
    """How to pick tokens: the config's ``generation:`` section, plus what the model and the run decide.

    ``top_k=0`` and ``top_p=1`` switch those filters off.
    """

    eos_token_ids: tuple[int, ...] | None = None  # None: the model config's stop_token_ids (every EOS id)
    pad_token_id: int = 0  # fills tokens after a sequence ended
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"need 0 <= min_new_tokens <= max_new_tokens and max_new_tokens >= 1, got "
                              f"min={self.min_new_tokens} max={self.max_new_tokens}")
        if not self.greedy and (self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0):
            raise ConfigError("sampling needs temperature > 0, 0 < top_p <= 1 and top_k >= 0")


@dataclass(frozen=True)
class GenerationOutput:
    """Generated tokens per prompt; positions past ``lengths[b]`` hold the pad token and logprob 0."""

    tokens: torch.Tensor  # [B, max_new_tokens] int64
    logprobs: torch.Tensor  # [B, max_new_tokens] float32: log p(token) under softmax(logits / temperature)
    lengths: torch.Tensor  # [B] int64, generated tokens including a final EOS

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths.tolist())]

    def token_logprobs(self) -> list[list[float]]:
        return [row[:n].tolist() for row, n in zip(self.logprobs, self.lengths.tolist())]


def _stage_step(module: StageModule, inputs: torch.Tensor, batch: PackedBatch, cache, select) -> torch.Tensor | None:
    """One forward of this stage inside the pipeline; the last stage returns its logits slice."""
    ctx = module.ctx
    if not ctx.is_first_stage:
        buffer = torch.empty(batch.num_tokens, module.cfg.hidden_size, dtype=module.dtype, device=inputs.device)
        inputs = recv_tensor(buffer, ctx.prev_rank)
    out = module(inputs, batch, cache=cache, select=select)
    if not ctx.is_last_stage:
        send_tensor(out, ctx.next_rank)
        return None
    return out


def _top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def choose_tokens(logits: torch.Tensor, params: SamplingParams, eos_ids: list[int], allow_eos: bool,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-probability from full-vocabulary logits ``[B, V]``."""
    logits = logits.float()
    if not params.greedy and params.temperature != 1.0:
        logits = logits / params.temperature
    logprobs = logits.log_softmax(-1)
    if not allow_eos and eos_ids:
        logits = logits.clone()
        logits[:, eos_ids] = float("-inf")
    if params.greedy:
        tokens = logits.argmax(-1)
    else:
        probs = _top_k_top_p(logits, params.top_k, params.top_p).softmax(-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _share(module: StageModule, tokens: torch.Tensor, logprobs: torch.Tensor, greedy: bool) -> None:
    """Make every rank of the replica hold the last stage's choice (in place)."""
    ctx = module.ctx
    if ctx.is_last_stage and ctx.tp_size > 1 and not greedy:  # one sampler decides for the TP group
        for t in (tokens, logprobs):
            dist.broadcast(t, src=ctx.tp_ranks[0], group=ctx.tp_group)
    if ctx.pp_size > 1:
        for t in (tokens, logprobs):
            dist.broadcast(t, src=ctx.last_stage_rank, group=ctx.pp_group)


def _join_sparse_layers(module: StageModule) -> None:
    """Take part in one step of this stage's sparse layers with no tokens of our own (ep: peers may send us theirs)."""
    empty = torch.empty(0, module.cfg.hidden_size, dtype=module.dtype, device=next(module.parameters()).device)
    for block in module.layers.values():
        if isinstance(block.mlp, MoEMLP):
            block.mlp(empty)


def _ep_peers_done(done: bool, module: StageModule) -> bool:
    """Whether every replica of this rank's ep group is done (one small all-reduce); ``done`` without ep."""
    ctx = module.ctx
    if ctx.ep_size == 1:
        return done
    flag = torch.tensor([1 if done else 0], dtype=torch.int64, device=next(module.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.ep_group)
    return bool(flag.item())


def _idle_until_peers_done(module: StageModule, steps: int) -> None:
    """Under ep, a replica with nothing (left) to generate joins its peers' steps until they are all done."""
    for _ in range(steps):
        _join_sparse_layers(module)
        if _ep_peers_done(True, module):
            return


@torch.no_grad()
def generate(module: StageModule, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams()) -> GenerationOutput:
    """Continue every prompt; all ranks of the model's replica must call it with the same prompts.

    Under ep every replica of an ep group must call it, with its own prompts or none: the replicas
    step in lockstep (their sparse layers exchange tokens) until all of them are done.
    """
    cfg, ctx = module.cfg, module.ctx
    device = next(module.parameters()).device
    batch_size = len(prompts)
    if batch_size == 0:
        if ctx.ep_size > 1:
            _idle_until_peers_done(module, params.max_new_tokens)
        empty = torch.zeros(0, params.max_new_tokens, device=device)
        return GenerationOutput(empty.long(), empty.float(), torch.zeros(0, dtype=torch.int64, device=device))
    longest = max(len(p) for p in prompts)
    if longest + params.max_new_tokens > cfg.max_positions:
        raise ConfigError(f"prompt of {longest} tokens + max_new_tokens={params.max_new_tokens} exceeds the model's "
                          f"{cfg.max_positions} positions; shorten the prompts or max_new_tokens")
    eos_ids = list(params.eos_token_ids if params.eos_token_ids is not None else cfg.stop_token_ids)
    generator = torch.Generator(device=device).manual_seed(params.seed) if not params.greedy else None
    cache = module.new_cache(batch_size, longest + params.max_new_tokens)
    inputs, batch = pack(prompts, device=device)
    select: torch.Tensor | None = batch.last_token_index()
    out_tokens = torch.full((batch_size, params.max_new_tokens), params.pad_token_id, dtype=torch.int64, device=device)
    out_logprobs = torch.zeros(batch_size, params.max_new_tokens, dtype=torch.float32, device=device)
    lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
    done = torch.zeros(batch_size, dtype=torch.bool, device=device)
    eos = torch.tensor(eos_ids, dtype=torch.int64, device=device)
    sizes = vocab_sizes(cfg.vocab_size, ctx)
    for step in range(params.max_new_tokens):
        cache.decoding = step > 0
        logits = _stage_step(module, inputs, batch, cache, select)
        tokens = torch.zeros(batch_size, dtype=torch.int64, device=device)
        logprobs = torch.zeros(batch_size, dtype=torch.float32, device=device)
        if ctx.is_last_stage:
            assert logits is not None  # the last stage's _stage_step returns its logits
            full = gather_from_tp(logits.float(), ctx, sizes)
            tokens, logprobs = choose_tokens(full, params, eos_ids, step >= params.min_new_tokens, generator)
        _share(module, tokens, logprobs, params.greedy)
        cache.advance(batch)
        live = ~done
        out_tokens[live, step] = tokens[live]
        out_logprobs[live, step] = logprobs[live]
        lengths += live.long()
        done |= torch.isin(tokens, eos)
        finished = bool(done.all())
        if _ep_peers_done(finished, module):
            break
        if finished:  # ep peers still generate: join their remaining steps without computing our own
            _idle_until_peers_done(module, params.max_new_tokens - step - 1)
            break
        inputs = tokens
        batch = PackedBatch.decode_step(cache.lengths.clone())
        select = None
    return GenerationOutput(out_tokens, out_logprobs, lengths)
