"""The cost of a generate MFC: one DP rank's requests decoded on restage's rollout engine (slots or a paged cache,
CUDA graphs, pipelined micro-groups, multi-turn episodes) or on a peer's one-batch engine (``generation_cost.py``
says how each engine holds and batches its requests; this file turns that into seconds and bytes)."""

from __future__ import annotations

import math
from typing import assert_never

from restage.cluster import ClusterSpec
from restage.graph import MFC
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.plan.activations import LOGIT_BYTES, forward_workspace_bytes
from restage.plan.comm import allgather_seconds, allreduce_seconds, broadcast_seconds, p2p_seconds
from restage.plan.compute import ComputeModel, RooflineCompute
from restage.plan.generation_cost import (
    HOST_CHECK_SECONDS,
    GenerationEngine,
    Occupancy,
    OneBatchEngine,
    RestageEngine,
    batched_generate_seconds,
    block_tokens,
    decode_rounds,
    flash_decodes,
    kv_budget_bytes,
    paged_flash,
    paged_occupancy,
    paged_triton,
    replays_graphs,
    restage_slots,
)
from restage.plan.layout_cost import (
    MFCCost,
    expert_exchange_seconds,
    max_stage_layers,
    sequences_per_rank,
    stage_seconds,
    worst_group,
)
from restage.plan.model_state import worst_stage
from restage.plan.roles import ModelRole
from restage.rollout.budget import group_count
from restage.rollout.paged_cache import blocks_for


def episode_figures(mfc: MFC) -> tuple[int, int, float]:
    """A generation's answers per episode, observation tokens per episode and one tool call's seconds (multi-turn
    episodes, ``algorithms/episode_sizes.py``); one answer, none and none without episodes."""
    episodes = mfc.options.episodes
    return (1, 0, 0.0) if episodes is None else (episodes.turns, episodes.observation_tokens, episodes.tool_seconds)


def restage_occupancy(cluster: ClusterSpec, engine: RestageEngine, mfc: MFC, role: ModelRole,
                      layout: Layout) -> Occupancy:
    """How restage's rollout engine holds one DP rank's requests: a paged cache (``generation_cost.paged_occupancy``; a
    multi-turn episode's observation tokens grow its cache as answer tokens do) or, ``generation.kv_cache:
    contiguous``, ``generation_cost.restage_slots``' slots of prompt + gen tokens."""
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    kv_token_bytes = 2 * max_stage_layers(cfg, s.pp) * block_shape(cfg, s.tp).kv_out * e
    weight_bytes = worst_stage(cfg, s)[0] * e
    requests = int(sequences_per_rank(mfc, s.dp))
    observed = episode_figures(mfc)[1]
    # generation.kv_cache=auto (None): paged where flash-attn's paged kernel serves, as rollout.flash_pages decides
    paged = engine.limits.paged if engine.limits.paged is not None else flash_decodes(cluster, engine, role.dtype)
    if not paged:
        live = restage_slots(cluster, engine, kv_token_bytes * (mfc.prompt_tokens + mfc.gen_tokens), weight_bytes,
                             requests)
        return Occupancy(live=live, cache_bytes=kv_token_bytes * (mfc.prompt_tokens + mfc.gen_tokens + observed) * live)
    return paged_occupancy(kv_budget_bytes(cluster, engine, weight_bytes), kv_token_bytes, mfc.prompt_tokens,
                           mfc.gen_tokens + observed, mfc.options.group, requests,
                           engine.limits.max_slots, block_tokens(cluster, engine, role.dtype))


def restage_live(cluster: ClusterSpec, engine: RestageEngine, mfc: MFC, role: ModelRole, layout: Layout) -> int:
    """Sequences the rollout engine decodes at once on one DP rank of ``layout`` (``restage_occupancy``)."""
    return restage_occupancy(cluster, engine, mfc, role, layout).live


def restage_decode_steps(occupancy: Occupancy, requests: int, gen_tokens: int) -> float:
    """Decode steps restage's rollout engine runs for ``requests`` answers: ``decode_rounds`` rounds of
    ``gen_tokens``, and the steps preempted requests had run, done again at the live batch's rate."""
    steps = decode_rounds(requests, occupancy.live) * gen_tokens
    return steps + occupancy.lost_steps / occupancy.live if occupancy.preempted else steps


def lockstep_forwards(cluster: ClusterSpec, engine: RestageEngine, mfc: MFC, role: ModelRole, layout: Layout) -> int:
    """Forwards one DP rank of restage's rollout engine runs for ``mfc`` in lockstep (ZeRO-3 generation in place,
    ``runtime/store/zero3_generation.py``): its decode steps (every answer ``gen_tokens`` long, ``restage_decode_steps``)
    and, per round of ``check_every_steps`` of them, one prefill or empty join (``rollout/engine.py``)."""
    b = int(sequences_per_rank(mfc, layout.strategy.dp))
    steps = math.ceil(restage_decode_steps(restage_occupancy(cluster, engine, mfc, role, layout), b, mfc.gen_tokens))
    return steps + math.ceil(steps / engine.limits.check_every_steps)


def generate_cost(cluster: ClusterSpec, compute: ComputeModel, graph_compute: RooflineCompute, mfc: MFC,
                  role: ModelRole, layout: Layout, engine: GenerationEngine) -> MFCCost:
    """A DP rank's requests on ``engine`` (``generation_cost.py``): ``live`` of them decoding at once in
    ``decode_rounds`` rounds; ``graph_compute`` (``GRAPH_BLOCK_SECONDS`` a block instead of the eager launch
    time) costs the steps the runtime replays as CUDA graphs.

    Under pp the one-batch engine runs the live batch through the stages one after another, and so does
    restage's with ``pp_groups=1``; by default restage's engine keeps ``G = pp`` micro-groups of ``live / G``
    slots in flight (``rollout/pipelined.py``): at each of a token's ``G`` ticks every stage steps
    one group at once, so a token of every live slot costs ``G`` stage steps over ``live / G`` slots
    instead of ``pp`` over ``live``, with one hand-over of a group's hidden states per tick and the
    group's tokens broadcast over the pipeline per tick."""
    cfg, s, e = role.arch, layout.strategy, role.bytes_per_element
    b = int(sequences_per_rank(mfc, s.dp))
    prompt, gen = mfc.prompt_tokens, mfc.gen_tokens
    # Multi-turn episodes (algorithms/episode_sizes.py): observation tokens share the cache, later turns prefill.
    turns, observed, tool_seconds = episode_figures(mfc)
    tp_group, pp_group = worst_group(layout, "tp"), worst_group(layout, "pp")
    layers = max_stage_layers(cfg, s.pp)
    hidden_bytes = cfg.hidden_size * e
    length = prompt + gen + observed
    window = min(length, cfg.sliding_window) if cfg.sliding_window else length
    kv_token_bytes = 2 * layers * block_shape(cfg, s.tp).kv_out * e  # one token's keys and values on the stage
    filled = prompt + (gen + observed + 1) / 2  # the average cache length while decoding
    gathered = 0  # positions a paged cache gathers per row and stage step for SDPA (none: read in place)
    match engine:
        case OneBatchEngine():  # every prompt prefilled whole (the head gives the first token), the batch held to the end
            live, prompts, prefix, head, graphs, checks = b, b, prompt, b, False, 0
            attended, groups = filled, 1
            occupancy = Occupancy(live=b, cache_bytes=kv_token_bytes * window * live)
        case RestageEngine():  # a group's prompt less its last token prefilled once, the siblings copy it
            occupancy = restage_occupancy(cluster, engine, mfc, role, layout)
            live = occupancy.live
            prompts, prefix, head = math.ceil(b / mfc.options.group), prompt - 1, 0
            groups = group_count(engine.limits.pp_groups, s.pp) if s.pp > 1 else 1
            graphs = replays_graphs(cluster, engine, cfg, s, groups)
            in_place = paged_flash(cluster, engine, role.dtype) or paged_triton(cluster, engine, role.dtype,
                                                                                cfg.head_dim)
            if occupancy.block_tokens and not in_place:
                # One gather of each row's blocks up to the longest row (a graph: the whole slot; eagerly, in the
                # steady state some row is near its end), then SDPA over those positions.
                attended = length
                gathered = blocks_for(length, occupancy.block_tokens) * occupancy.block_tokens
            else:  # flash-attn and the paged Triton kernel read each row's own length; SDPA on slots: a graph's
                # over the whole slot, masked
                own = flash_decodes(cluster, engine, role.dtype) or bool(occupancy.block_tokens)
                attended = length if graphs and not own else filled
            checks = (math.ceil(restage_decode_steps(occupancy, b, gen) / engine.limits.check_every_steps)
                      if cluster.has_gpus else 0)
        case _:
            assert_never(engine)
    tokens = prompts * prefix
    # Prefill: a forward over the prompts, stage after stage (the one-batch engine's head on each last prompt token).
    prefill_stage = stage_seconds(layout, cfg, compute.block_prefill(prompts, prefix, s.tp, s.ep) if prefix else 0.0,
                                   compute.embed_forward(tokens), compute.head_forward(head, s.tp) if head else 0.0)
    prefill_comm = layers * 2 * allreduce_seconds(cluster, tp_group, tokens * hidden_bytes) if tokens else 0.0
    prefill_send = p2p_seconds(cluster, pp_group[0], pp_group[-1], tokens * hidden_bytes) if s.pp > 1 and tokens else 0.0
    prefill_ep = s.pp * expert_exchange_seconds(cluster, cfg, layout, tokens, e)
    # A group's siblings copy the prompt's keys and values (read and written once each); in a paged cache only those
    # of its partial last block, the full ones being shared.
    copied = prefix % occupancy.block_tokens if occupancy.block_tokens else prefix
    copy = 2 * (b - prompts) * copied * kv_token_bytes / cluster.achievable_memory_bandwidth()
    prefill = s.pp * (prefill_stage + prefill_comm) + (s.pp - 1) * prefill_send + prefill_ep + copy
    turn_prefill = _turn_prefill_seconds(cluster, compute, layout, cfg, b * (turns - 1), filled, hidden_bytes)
    prefill += turn_prefill
    # A step (a token of every live slot): `calls` stage steps over `batch` slots each, back to back on a stage:
    # the live batch through all pp stages one after the other, or G micro-groups' ticks, every stage busy.
    calls, batch = (groups, math.ceil(live / groups)) if groups > 1 else (s.pp, live)
    def decode_stage_seconds(step_compute: ComputeModel) -> float:
        return stage_seconds(layout, cfg, step_compute.decode_block(batch, attended, s.tp, s.ep),
                              step_compute.embed_forward(batch), step_compute.head_forward(batch, s.tp))
    # A paged gather reads each row's own blocks (about the tokens it holds; the positions it does not hold read the
    # one scratch block, which stays in the L2 cache) and writes the whole span side by side for SDPA.
    gather = batch * (filled + gathered) * kv_token_bytes / cluster.achievable_memory_bandwidth() if gathered else 0.0
    decode_stage = decode_stage_seconds(graph_compute if graphs else compute) + gather
    # Each stage call captures its bucket's graph once (under micro-groups one graph per group: ``DecodeGraphs`` keys
    # them by (group start, bound)): a warm-up step and the capture, each as long as an eager stage step.
    capture = 2 * calls * (decode_stage_seconds(compute) + gather) if graphs else 0.0
    # Per stage call, two all-reduces per block; per step, the sampler gathers the full-vocabulary logits over
    # TP, the hidden states cross the stage boundaries, and the chosen tokens and their log-probabilities are
    # broadcast over TP (unless greedy) and over the pipeline (once a step, or once a tick for its group).
    chosen = 2 * batch * 8
    decode_comm = calls * layers * 2 * allreduce_seconds(cluster, tp_group, batch * hidden_bytes) + allgather_seconds(
        cluster, tp_group, live * cfg.vocab_size * LOGIT_BYTES) + (0 if mfc.greedy else 2 * broadcast_seconds(
            cluster, tp_group, 2 * live * 8)) + (calls if groups > 1 else 2) * broadcast_seconds(cluster, pp_group, chosen)
    hand_overs = groups if groups > 1 else s.pp - 1  # per tick the stages hand over at once; else pp - 1 in turn
    decode_send = hand_overs * p2p_seconds(cluster, pp_group[0], pp_group[-1], batch * hidden_bytes) if s.pp > 1 else 0.0
    decode_ep = s.pp * expert_exchange_seconds(cluster, cfg, layout, live, e)
    step = calls * decode_stage + decode_comm + decode_send + decode_ep
    host_checks = checks * HOST_CHECK_SECONDS
    tool = (turns - 1) * tool_seconds  # an episode's tool calls, one after another
    # Preempted requests (a paged cache's first wave, ``generation_cost.paged_occupancy``): their decode steps again, at the
    # live batch's rate, and their prompts prefilled again.
    first_prefill = s.pp * (prefill_stage + prefill_comm) + (s.pp - 1) * prefill_send + prefill_ep
    preemption = (occupancy.lost_steps / live * step + occupancy.preempted / prompts * first_prefill
                  if occupancy.preempted else 0.0)
    seconds = batched_generate_seconds(prefill, step, b, live, gen) + host_checks + capture + tool + preemption
    steps = decode_rounds(b, live) * gen
    parts = {"prefill_seconds": prefill, "decode_seconds": steps * step,
             "compute_seconds": s.pp * prefill_stage + steps * calls * decode_stage,
             "tp_comm_seconds": s.pp * prefill_comm + steps * decode_comm,
             "pp_send_seconds": (s.pp - 1) * prefill_send + steps * decode_send, "ep_comm_seconds": prefill_ep + steps * decode_ep}
    parts.update({k: v for k, v in (("kv_copy_seconds", copy), ("host_check_seconds", host_checks),
                                    ("graph_capture_seconds", capture), ("turn_prefill_seconds", turn_prefill),
                                    ("tool_seconds", tool), ("kv_gather_seconds", steps * calls * gather),
                                    ("preemption_seconds", preemption)) if v})
    # Memory: the KV cache (slots of the whole length, or a paged cache's pool; ``Occupancy``), a paged gather's one
    # layer of keys and values, one admission's prefill workspace, the step's logits.
    gather_workspace = 2 * batch * gathered * block_shape(cfg, s.tp).kv_out * e
    transient = (occupancy.cache_bytes + gather_workspace + forward_workspace_bytes(cfg, s.tp, min(prompts, live) * prefix, e)
                 + live * block_shape(cfg, s.tp).head_out * LOGIT_BYTES)
    return MFCCost(seconds, transient, parts)


def _turn_prefill_seconds(cluster: ClusterSpec, compute: ComputeModel, layout: Layout, cfg: ModelConfig, prefills: float,
                          context: float, hidden_bytes: int) -> float:
    """Multi-turn episodes: ``prefills`` later turns, each prefilling its whole context (about ``context`` tokens)
    stage after stage, with the TP all-reduces of those tokens."""
    if prefills <= 0:
        return 0.0
    s, seq = layout.strategy, max(1, round(context))
    stage = stage_seconds(layout, cfg, compute.block_prefill(prefills, seq, s.tp, s.ep), compute.embed_forward(
        prefills * seq), 0.0)
    comm = max_stage_layers(cfg, s.pp) * 2 * allreduce_seconds(cluster, worst_group(layout, "tp"),
                                                               prefills * seq * hidden_bytes)
    return s.pp * (stage + comm)
