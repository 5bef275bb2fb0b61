"""Generation engines as the estimator costs them: restage's rollout engine, vLLM, and one batch decoded to the end.

Three engines share one mechanism, continuous batching over a KV cache (``decode_rounds``,
``batched_generate_seconds``): with ``live`` sequences in flight and a finished sequence's place
refilled at once, ``n_seqs`` answers of ``gen`` tokens take ``ceil(n_seqs / live)`` rounds of
``gen`` decoding steps of ``live`` sequences. Every answer is costed at its full ``gen`` tokens
(the MFC carries one length), the same for every engine. They differ in what sets ``live``, what
a step costs and what a prefill covers:

* **restage's rollout engine** (``RestageEngine``; ``rollout/engine.py``, ``rollout/paged_cache.py``,
  ``rollout/decode_graphs.py``), costed by ``rollout_cost.generate_cost``. Its cache is paged by default
  (``generation.kv_cache``; ``restage_occupancy``): ``min(max_slots, requests)`` rows over a pool of
  blocks of ``block_tokens`` (``block_tokens``: 256 where flash-attn's paged kernel serves, else 16), as
  many as the budget holds; a request holds the blocks of the tokens it has cached, a group's prompt
  blocks once, so ``live`` is the rows the pool holds at the tokens a request holds on average
  (``paged_occupancy``: answers spread over their positions, the steady state of continuous batching
  and the length model of the vLLM peers below), and the first wave's requests, which start together,
  are preempted where their growth overruns the pool (their work done again). Contiguous
  (``generation.kv_cache: contiguous``): ``live`` = its slots, ``rollout.budget.slot_count`` of the
  budget over a slot of ``prompt + gen`` tokens. The budget is ``generation.kv_cache_gib`` (0:
  ``GPU_FREE_MEMORY_FRACTION`` of the memory the rank's weights leave; ``CPU_KV_CACHE_BYTES`` on a CPU).
  A group's prompt (``group_size``) is prefilled once (all but its last token) and its KV copied to
  the siblings (paged: only its partial last block); decode steps replayed as CUDA graphs where the
  runtime replays them (``replays_graphs``: ``rollout.decode_graphs.choose_decode_mode``; under pp with
  micro-groups in flight, a graph per micro-group and bucket on each stage, the sends between stages eager):
  a block's kernels take at least ``GRAPH_BLOCK_SECONDS`` instead of the eager ``block_overhead_seconds``
  and each call captures its graphs once (a warm-up step and a capture, each costed as one eager step per
  stage call); eager elsewhere (per-block launch time). Attention reads, per sequence,
  its own cached tokens where flash-attn serves (``flash_decodes``, ``paged_flash``), and so does a paged
  cache's Triton kernel on a GPU without flash-attn's paged kernel (``paged_triton``: ``RestageEngine.triton``,
  blocks of ``DEFAULT_BLOCK_TOKENS``, no gather); else SDPA: over the filled prefix eagerly and the whole slot
  in a graph, and a paged cache first gathers each row's blocks up to the longest row's, about the whole slot
  (read and written, then read by SDPA). One host
  sync every ``check_every_steps`` steps (``HOST_CHECK_SECONDS`` each on a GPU).
* **vLLM** (``VllmEngine``, ``vllm_generate_seconds``), for the peers' baselines and the calibration:
  CUDA graphs (``RooflineCompute(launch_overhead_seconds=0)``); a paged KV cache, so ``live`` is as
  many sequences as ``gpu_memory_utilization`` (vLLM's ``EngineArgs`` default 0.9) of the device
  memory less the weights holds at their average length ``prompt + gen / 2``; every prompt
  prefilled; two TP all-reduces per block; ``step_overhead_seconds`` of host time a step (0 by default;
  ``ray_tp_step_seconds``: what vLLM <= 0.4.0's Ray-based tensor parallelism adds, for the engines of
  that era). Not modelled: vLLM's scheduler and sampler time per step (host work between CUDA-graph
  replays) and prefix caching; both are zero here.
* **one batch to the end, eagerly** (``OneBatchEngine``): every prompt of a rank prefilled and
  decoded together until the last answer ends, the whole batch's KV cache held, eager launches.
  DeepSpeed-Chat's Hybrid Engine generates so (``plan/peers/peer_engines.py``), as restage's runtime did
  before its rollout engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from restage.cluster import ClusterSpec
from restage.layout import Strategy
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.models.sharding import stage_layers
from restage.plan.comm import allreduce_seconds
from restage.plan.compute import DTYPE_BYTES, RooflineCompute
from restage.rollout.budget import CPU_KV_CACHE_BYTES, GPU_FREE_MEMORY_FRACTION, RolloutLimits, slot_count
from restage.rollout.decode_graphs import choose_decode_mode
from restage.rollout.paged_attention_triton import head_dim_supported
from restage.rollout.paged_cache import DEFAULT_BLOCK_TOKENS, FLASH_BLOCK_TOKENS, blocks_for

# Measured on one H100 with restage's own engine (docs/plan.md, "GPU cost constants"):
# * the time one block's kernels take when replayed from a CUDA graph and their device work is negligible: the
#   launch and fixed cost of each of its ``compute.KERNELS_PER_BLOCK`` kernels inside the graph (about 3.1 us each);
# * the time one check of the engine adds (``RolloutEngine._reap``: ``tolist`` waits for the queued steps, then the
#   host's bookkeeping before the next step is launched), during which the GPU idles.
GRAPH_BLOCK_SECONDS = 1.35e-4
HOST_CHECK_SECONDS = 8.5e-5
# vLLM up to 0.4.0 ran a tensor-parallel engine's workers as Ray actors and scheduled a Ray task on every worker at
# every step (``_run_workers("execute_model")``), then waited for them; vllm-project/vllm PR #3763 (A100 80GB,
# llama-2-7b, one request of 5 prompt tokens, 2,000 generated) measured 24.2 s at TP 2 with Ray and 17.0 s at TP 2
# with the multiprocessing executor of PR #3466: (24.2 - 17.0) / 2000 = 3.6 ms a step of host time that the Ray
# execution adds. OpenRLHF's benchmark ran vLLM 0.3.1 (bench/published.py); newer vLLM does not pay it.
VLLM_RAY_TP_STEP_SECONDS = (24.2 - 17.0) / 2000


@dataclass(frozen=True)
class RestageEngine:
    """restage's rollout engine as configured: ``generation.kv_cache_gib`` / ``max_slots`` / ``kv_cache`` /
    ``kv_block_tokens`` (``limits``) and ``generation.cuda_graphs``; ``flash_attn``: whether flash-attn is installed
    where the ranks run (``planner.engine_of``), which decides the runtime's block size and attention kernel;
    ``triton``: whether a paged cache may read its blocks with restage's Triton kernel where flash-attn's does not
    serve (``rollout.paged_cache.paged_kernel``; ``engine_of`` sets it where ``kv_cache: paged`` is asked for and
    triton is installed), else it gathers them."""

    limits: RolloutLimits = RolloutLimits()
    cuda_graphs: bool = True
    partitioned: bool = False  # generating in its ZeRO-3 training layout (``PlanProblem.in_place_seconds``)
    flash_attn: bool = False
    triton: bool = False


@dataclass(frozen=True)
class OneBatchEngine:
    """A rank's prompts prefilled and decoded as one batch to the end, eagerly (DeepSpeed-Chat's Hybrid Engine)."""


GenerationEngine = RestageEngine | OneBatchEngine


def kv_budget_bytes(cluster: ClusterSpec, engine: RestageEngine, weight_bytes: float) -> int:
    """The rollout engine's KV budget on one rank (``rollout.budget.kv_budget_bytes``): the configured one, else
    ``GPU_FREE_MEMORY_FRACTION`` of the usable memory the rank's weights leave (the runtime takes it of the memory
    free when the engine is built; the other models a plan keeps on the rank are not subtracted here), or
    ``CPU_KV_CACHE_BYTES`` on a CPU."""
    budget = engine.limits.kv_cache_bytes
    if budget is None:
        budget = (int(GPU_FREE_MEMORY_FRACTION * (cluster.usable_memory_bytes - weight_bytes)) if cluster.has_gpus
                  else CPU_KV_CACHE_BYTES)
    return budget


def restage_slots(cluster: ClusterSpec, engine: RestageEngine, slot_bytes: float, weight_bytes: float,
                  requests: int) -> int:
    """The contiguous cache's slots on one rank, by ``rollout.budget.plan_slots``' rule over ``kv_budget_bytes``. At
    least one: a budget under one slot, which the runtime refuses, is costed as one slot (its memory then shows the
    overdraft)."""
    budget = kv_budget_bytes(cluster, engine, weight_bytes)
    return max(1, slot_count(budget, math.ceil(slot_bytes), requests, engine.limits.max_slots))


def flash_decodes(cluster: ClusterSpec, engine: RestageEngine, dtype: str) -> bool:
    """Whether flash-attn's kernels serve the decode (``models.attention.use_flash``: installed, CUDA, half precision)."""
    return engine.flash_attn and cluster.has_gpus and dtype in ("bf16", "fp16")


def block_tokens(cluster: ClusterSpec, engine: RestageEngine, dtype: str) -> int:
    """A paged cache's block (``rollout.budget.block_tokens_for``): ``generation.kv_block_tokens``, else
    ``FLASH_BLOCK_TOKENS`` where flash-attn serves, else ``DEFAULT_BLOCK_TOKENS``."""
    if engine.limits.block_tokens:
        return engine.limits.block_tokens
    return FLASH_BLOCK_TOKENS if flash_decodes(cluster, engine, dtype) else DEFAULT_BLOCK_TOKENS


def paged_flash(cluster: ClusterSpec, engine: RestageEngine, dtype: str) -> bool:
    """Whether a paged decode runs flash-attn's paged kernel (``PagedKVCache.decode_attention``: flash serves and the
    block is a multiple of ``FLASH_BLOCK_TOKENS``), reading each row's own tokens; else it gathers blocks for SDPA."""
    return flash_decodes(cluster, engine, dtype) and block_tokens(cluster, engine, dtype) % FLASH_BLOCK_TOKENS == 0


def paged_triton(cluster: ClusterSpec, engine: RestageEngine, dtype: str, head_dim: int) -> bool:
    """Whether a paged decode runs restage's Triton kernel (``rollout.paged_cache.paged_kernel``: a GPU, triton, a
    dtype and head dim it supports, flash-attn's paged kernel not serving), reading each row's own blocks in place."""
    return (engine.triton and cluster.has_gpus and dtype in ("bf16", "fp16", "fp32") and head_dim_supported(head_dim)
            and not paged_flash(cluster, engine, dtype))


@dataclass(frozen=True)
class Occupancy:
    """How restage's rollout engine holds one rank's requests in its KV cache.

    ``live``: sequences decoding at once; ``cache_bytes``: what the cache allocates; ``block_tokens``: a paged
    cache's block (0: contiguous slots); ``mean_blocks``: the blocks a request holds on average over its answer;
    ``preempted``: requests preempted once (their blocks given back, done again from their prompt); ``lost_steps``:
    the decode steps, summed over those requests, they had run when preempted."""

    live: int
    cache_bytes: float
    block_tokens: int = 0
    mean_blocks: float = 0.0
    preempted: int = 0
    lost_steps: float = 0.0


def paged_occupancy(budget_bytes: int, token_bytes: float, prompt: int, answer: int, group: int, requests: int,
                    max_slots: int, block: int) -> Occupancy:
    """The paged cache (``rollout.budget.new_rollout_cache``) for ``requests`` of ``prompt`` + ``answer`` tokens, in
    groups of ``group`` siblings, with ``token_bytes`` of keys and values a token.

    Pool: ``min(budget // block_bytes, rows x blocks_for(max_len))`` blocks (one more, the scratch block, is
    allocated), ``rows = min(max_slots, requests)``. A request is admitted with its prompt less its last token
    cached (``prompt - 1``; a sibling shares the group's full blocks of them, ``(prompt - 1) // block``) and at
    its answer's step ``t`` (1 .. ``answer``) holds ``prompt - 1 + t`` tokens. ``live``: the rows the pool holds
    at the blocks a request holds on average over its steps (shared blocks split among the siblings): answers
    spread over their positions, as continuous batching runs once they end at different times (the estimator's
    one answer length gives the step count; the vLLM peers' ``live_sequences`` takes the same average).

    Preemption: the first ``min(rows, requests)`` requests the pool admits start together and grow in step; at
    step ``t`` the pool holds ``floor(blocks / held(t))`` of them and the engine preempts the newest beyond that
    (``RolloutEngine._grow``). Those not held at the last step are preempted; ``lost_steps`` counts the steps
    they ran. None are when the pool holds every first-wave request at its full length."""
    rows = min(max_slots, requests)
    block_bytes = token_bytes * block
    blocks = min(int(budget_bytes // block_bytes), rows * blocks_for(prompt + answer, block))
    shared = (prompt - 1) // block if group > 1 else 0  # a group's full prompt blocks, held once

    def held(t: int) -> float:  # a request's blocks at answer step t (admitted with t = 1's), its group's share once
        return shared / group + blocks_for(prompt - 1 + t, block) - shared

    steps = range(1, max(1, answer) + 1)
    mean_blocks = sum(held(t) for t in steps) / len(steps)
    live = max(1, min(rows, math.floor(blocks / mean_blocks)))
    first = max(1, min(rows, math.floor(blocks / held(1))))
    holding = [min(first, math.floor(blocks / held(t))) for t in steps]  # the first wave's requests at step t
    kept = max(1, holding[-1])
    return Occupancy(live=live, cache_bytes=(blocks + 1) * block_bytes, block_tokens=block, mean_blocks=mean_blocks,
                     preempted=max(0, first - kept), lost_steps=float(sum(max(0, h - kept) for h in holding)))


def replays_graphs(cluster: ClusterSpec, engine: RestageEngine, cfg: ModelConfig, s: Strategy, groups: int = 1) -> bool:
    """Whether the runtime replays this layout's decode steps as CUDA graphs: ``choose_decode_mode``'s rule with the
    engine's ``groups`` micro-groups in flight (under pp, each stage replays one graph per micro-group and bucket,
    its sends outside; ``pp_groups=1``, the stages one after another, decodes eagerly)."""
    device = torch.device("cuda" if cluster.has_gpus else "cpu")
    return choose_decode_mode(device, enabled=engine.cuda_graphs, tp_size=s.tp, pp_size=s.pp, ep_size=s.ep,
                              sparse=cfg.is_moe, partitioned=engine.partitioned, micro_groups=groups)[0] == "graphs"


@dataclass(frozen=True)
class VllmEngine:
    """One vLLM engine: ``tp`` devices (ranks ``first_rank ..``), its memory setting and per-step host time.

    ``max_live_sequences``: at most this many prompts in flight (a caller that submits prompts in
    batches, as OpenRLHF 0.2 did per ``micro_rollout_batch_size``); ``None``: as many as the KV cache holds.
    """

    tp: int = 1
    gpu_memory_utilization: float = 0.9
    step_overhead_seconds: float = 0.0
    first_rank: int = 0
    max_live_sequences: int | None = None


def ray_tp_step_seconds(tp: int) -> float:
    """Per-step host time of a vLLM <= 0.4.0 engine that runs its ``tp`` workers as Ray actors (none at tp 1: the
    engine runs its one worker in its own process)."""
    return VLLM_RAY_TP_STEP_SECONDS if tp > 1 else 0.0


def kv_bytes_per_token(cfg: ModelConfig, tp: int, dtype: str) -> float:
    """KV-cache bytes one token takes on one rank of a ``tp``-way engine (every layer's keys and values)."""
    return 2 * cfg.num_layers * block_shape(cfg, tp).kv_out * DTYPE_BYTES[dtype]


def live_sequences(cluster: ClusterSpec, cfg: ModelConfig, dtype: str, engine: VllmEngine, n_seqs: int,
                   avg_tokens: float, weight_elements: float) -> float:
    """Sequences a vLLM engine keeps in flight: as many as its KV cache holds at ``avg_tokens`` each (at least 1)."""
    free_bytes = cluster.memory_bytes * engine.gpu_memory_utilization - weight_elements * DTYPE_BYTES[dtype]
    capacity = free_bytes / (kv_bytes_per_token(cfg, engine.tp, dtype) * avg_tokens)
    if engine.max_live_sequences is not None:
        capacity = min(capacity, engine.max_live_sequences)
    return max(1.0, min(float(n_seqs), capacity))


def decode_rounds(n_seqs: int, live: float) -> int:
    """Rounds of decoding steps ``n_seqs`` answers of one length take with ``live`` in flight, refilled at once."""
    return math.ceil(n_seqs / live - 1e-9) if live < n_seqs else 1


def batched_generate_seconds(prefill_seconds: float, step_seconds: float, n_seqs: int, live: float,
                             gen_tokens: int) -> float:
    """Continuous batching: the prefills, then ``decode_rounds`` rounds of ``gen_tokens`` steps of ``live`` sequences."""
    return prefill_seconds + decode_rounds(n_seqs, live) * gen_tokens * step_seconds


def vllm_generate_seconds(cluster: ClusterSpec, cfg: ModelConfig, dtype: str, engine: VllmEngine, n_seqs: int,
                          prompt_tokens: int, gen_tokens: int) -> float:
    """Seconds one vLLM engine takes to generate ``gen_tokens`` tokens for each of ``n_seqs`` prompts."""
    compute = RooflineCompute(cluster, cfg, dtype, launch_overhead_seconds=0.0)
    layers = len(range(*stage_layers(cfg, 1)[0]))
    s = block_shape(cfg, engine.tp)
    weights = layers * s.weight_params + 2 * cfg.vocab_size * cfg.hidden_size / engine.tp
    ctx = prompt_tokens + (gen_tokens + 1) / 2
    live = live_sequences(cluster, cfg, dtype, engine, n_seqs, ctx, weights)
    group = tuple(range(engine.first_rank, engine.first_rank + engine.tp))
    hidden_bytes = cfg.hidden_size * DTYPE_BYTES[dtype]
    prefill = (layers * (compute.block_prefill(n_seqs, prompt_tokens, engine.tp)
                         + 2 * allreduce_seconds(cluster, group, n_seqs * prompt_tokens * hidden_bytes))
               + compute.head_forward(n_seqs, engine.tp))
    step = (layers * (compute.decode_block(live, ctx, engine.tp) + 2 * allreduce_seconds(cluster, group, live * hidden_bytes))
            + compute.embed_forward(live) + compute.head_forward(live, engine.tp) + engine.step_overhead_seconds)
    return batched_generate_seconds(prefill, step, n_seqs, live, gen_tokens)
