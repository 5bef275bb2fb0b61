"""Generation as other engines run it: vLLM (CUDA graphs, continuous batching, paged KV cache).

restage's runtime generates with eager PyTorch (``estimator._generate``: per-block launch overhead, the
whole batch's KV cache held at once). Peers generate with vLLM, so their baselines, and the calibration
against their published measurements (``bench/calibration.py``), cost generation as vLLM runs it:

* CUDA graphs: no per-block host overhead (``RooflineCompute(launch_overhead_seconds=0)``);
* continuous batching over a paged KV cache: the sequences in flight are as many as the KV cache
  holds at their average length (``prompt + gen / 2``), not the whole batch; a finished sequence's
  slot is refilled at once, so ``n_seqs`` sequences take ``n_seqs / live`` rounds of ``gen`` steps;
* the KV cache gets ``gpu_memory_utilization`` of the device memory less the weights (vLLM's
  ``gpu_memory_utilization``, default 0.9 in vLLM's ``EngineArgs``);
* tensor parallelism inside one engine: two all-reduces of the live batch's hidden states per block.

Not modelled: vLLM's scheduler and sampler time per step (host work between CUDA-graph replays) and
prefix caching; both are zero here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from restage.cluster import ClusterSpec
from restage.models.config import ModelConfig
from restage.models.flops import block_shape
from restage.models.sharding import stage_layers
from restage.plan.comm import allreduce_seconds
from restage.plan.compute import DTYPE_BYTES, RooflineCompute


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
    rounds = math.ceil(n_seqs / live - 1e-9) if live < n_seqs else 1
    return prefill + rounds * gen_tokens * step
