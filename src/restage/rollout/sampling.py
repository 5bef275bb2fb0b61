"""How tokens are picked (``SamplingParams``) and picking them: temperature, top-k, top-p, min-p, EOS held back,
and counter-based noise.

Why counter-based noise: a sampled token must depend on its own request only, never on which
batch-mates or cache slot it decoded beside, so that a batch of one and a full batch give the same
tokens. One ``torch.Generator`` per request would do it but costs a generator call per row per step
(and a kernel per row on a GPU). Instead the Gumbel-max trick draws from
``softmax(filtered logits)`` as ``argmax(filtered logits + g)`` with ``g = -log(-log(u))`` and
``u = hash(request key, step, token id)``: a pure function of the request's seed, the token's index
in the answer and the vocabulary entry, computed for the whole ``[B, V]`` batch in a few integer
ops, with no generator state, no host sync and fixed shapes (so it fits a CUDA graph later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from restage.config.sections import GenerationConfig
from restage.errors import ConfigError
from restage.models.parallel import ParallelContext, gather_from_tp, vocab_sizes


@dataclass(frozen=True)
class SamplingParams(GenerationConfig):
    """How to pick tokens: the config's ``generation:`` section, plus what the model and the run decide.

    ``top_k=0``, ``top_p=1`` and ``min_p=0`` switch those filters off.
    """

    eos_token_ids: tuple[int, ...] | None = None  # None: the model config's stop_token_ids (every EOS id)
    pad_token_id: int = 0  # fills tokens after a sequence ended
    seed: int = 0  # request r's noise is seeded by request_seed(seed, r) unless generate is given seeds

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1 or self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"need 0 <= min_new_tokens <= max_new_tokens and max_new_tokens >= 1, got "
                              f"min={self.min_new_tokens} max={self.max_new_tokens}")
        if not self.greedy and (self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0
                                or not 0 <= self.min_p < 1):
            raise ConfigError("sampling needs temperature > 0, 0 < top_p <= 1, top_k >= 0 and 0 <= min_p < 1")



_MASK32 = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of each value of an int64 tensor (lowbias32's shape).

    Both multipliers are below 2**31, so every product of a 32-bit value stays inside int64 (no
    overflow on any device) and the hash is the same wherever it runs.
    """
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK32
    return x ^ (x >> 16)


def request_keys(seeds: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[R]`` int64 32-bit keys, one per request seed (any Python int)."""
    values = [s % (1 << 64) for s in seeds]
    lo = torch.tensor([v & _MASK32 for v in values], dtype=torch.int64)
    hi = torch.tensor([v >> 32 for v in values], dtype=torch.int64)
    return hash32(hash32(lo) ^ hash32(hi + 0x9E3779B9)).to(device)


def request_seed(seed: int, request: int) -> int:
    """The default seed of request ``request`` of a run seeded ``seed``."""
    return (seed * 1_000_003 + request) % (1 << 64)


def gumbel_noise(keys: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``[B, C]`` fp32 Gumbel noise for rows with keys ``[B]`` at answer positions ``steps`` ``[B]`` over ``token_ids``.

    ``token_ids`` is ``[C]`` (the whole vocabulary) or ``[B, C]`` (candidates per row): the noise of a
    token does not depend on which other tokens are scored.
    """
    row = hash32(keys ^ hash32(steps + 0x632BE5AB))
    ids = token_ids if token_ids.dim() == 2 else token_ids.unsqueeze(0)
    bits = hash32(row.unsqueeze(1) ^ hash32(ids + 0x85EBCA6B))
    uniform = ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))  # in (0, 1), exactly representable
    return -torch.log(-torch.log(uniform))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Temperature-scaled ``[B, V]`` logits with the tokens top-k, top-p and min-p drop set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p < 1.0:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # Drop a token when the tokens ranked above it already cover top_p; the first always stays.
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def choose_tokens(logits: torch.Tensor, *, greedy: bool, temperature: float, top_k: int, top_p: float, min_p: float,
                  eos: torch.Tensor, allow_eos: torch.Tensor, keys: torch.Tensor, steps: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-probability (under ``softmax(logits / temperature)``) from ``[B, V]`` logits.

    ``eos``: the ids held back on rows where ``allow_eos`` (``[B]`` bool: min_new_tokens reached) is False;
    ``keys``/``steps`` ``[B]`` seed each row's noise (unused when greedy).
    """
    logits = logits.float()
    if not greedy and temperature != 1.0:
        logits = logits / temperature
    logprobs = logits.log_softmax(-1)
    if eos.numel():
        # index_fill_ takes its value as a kernel argument; ``banned[:, eos] = True`` would copy a host tensor
        # of True to the device, which a CUDA-graph capture refuses (seen on an H200 with min_new_tokens set).
        banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device).index_fill_(0, eos, True)
        logits = logits.masked_fill(banned & ~allow_eos.unsqueeze(1), float("-inf"))
    if greedy:
        tokens = logits.argmax(-1)
    else:
        filtered = filter_logits(logits, top_k, top_p, min_p)
        if 0 < top_k < logits.shape[-1]:  # score only the k candidates: their noise is the full vocabulary's
            values, ids = filtered.topk(top_k, dim=-1)
            tokens = ids.gather(-1, (values + gumbel_noise(keys, steps, ids)).argmax(-1, keepdim=True)).squeeze(-1)
        else:
            vocab = torch.arange(logits.shape[-1], device=logits.device)
            tokens = (filtered + gumbel_noise(keys, steps, vocab)).argmax(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class SlotSampler:
    """The next token of each decoded slot: chosen on the last stage from the logits gathered over TP, with each
    slot's noise key, then held by every rank of the replica (``share``)."""

    def __init__(self, ctx: ParallelContext, vocab_size: int, params: SamplingParams, eos_ids: Sequence[int],
                 device: torch.device):
        self.ctx, self.params, self.device = ctx, params, device
        # An id past the vocabulary (some configs list one) is never sampled.
        self.eos = torch.tensor([i for i in eos_ids if 0 <= i < vocab_size], dtype=torch.int64, device=device)
        self.is_eos = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # a gather, not isin's sort
        self.is_eos[self.eos] = True
        self.vocab_sizes = vocab_sizes(vocab_size, ctx)

    def choose(self, logits: torch.Tensor | None, keys: torch.Tensor,
               steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's tokens and log-probs for slots with noise ``keys`` at answer ``steps`` (zeros on the
        other stages, to be overwritten by ``share``)."""
        params, ctx = self.params, self.ctx
        bound = steps.shape[0]
        tokens = torch.zeros(bound, dtype=torch.int64, device=self.device)
        logprobs = torch.zeros(bound, dtype=torch.float32, device=self.device)
        if ctx.is_last_stage:
            assert logits is not None  # the last stage's forward returns its logits
            full = gather_from_tp(logits.float(), ctx, self.vocab_sizes)
            held_back = self.eos if params.min_new_tokens else self.eos[:0]  # EOS ids banned before min_new_tokens
            tokens, logprobs = choose_tokens(full, greedy=params.greedy, temperature=params.temperature,
                                             top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                                             eos=held_back, allow_eos=steps >= params.min_new_tokens,
                                             keys=keys, steps=steps)
        return tokens, logprobs

    def share_over_tp(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """On the last stage, make every TP rank hold the sampler's choice (greedy: they already agree)."""
        ctx = self.ctx
        if ctx.is_last_stage and ctx.tp_size > 1 and not self.params.greedy:  # one sampler decides for the TP group
            for t in (tokens, logprobs):
                dist.broadcast(t, src=ctx.tp_ranks[0], group=ctx.tp_group)

    def share(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Make every rank of the replica hold the last stage's choice (in place)."""
        ctx = self.ctx
        self.share_over_tp(tokens, logprobs)
        if ctx.pp_size > 1:
            for t in (tokens, logprobs):
                dist.broadcast(t, src=ctx.last_stage_rank, group=ctx.pp_group)
