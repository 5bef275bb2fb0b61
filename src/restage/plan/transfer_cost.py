"""Bytes and seconds of parameter reallocation and of data transfer between MFCs.

Reallocation has two implementations that count the same bytes: ``exact_realloc`` runs the
runtime's planner (``schedule/realloc_plan.py``, which decides who sends which piece), and
``fast_realloc`` does the same arithmetic per (stage, TP chunk) instead of per parameter, fast
enough for the search's inner loop. The search uses the fast one; the schedule's reallocation
steps carry the exact planner's bytes and the seconds computed from them. For a LoRA model
(``adapters_only``) both count only the adapters: its copies keep the frozen base between steps.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache

from restage.cluster import ClusterSpec
from restage.graph import MFC
from restage.layout import Layout
from restage.models.arch import ModelConfig
from restage.models.sharding import is_adapter, param_specs, split_range, stage_layers
from restage.plan.comm import allgather_seconds, links_seconds
from restage.plan.model_state import stage_param_elements
from restage.schedule.realloc_plan import contiguous_chunks, plan_reallocation

# Bytes per token (or per sequence) of the keys MFCs hand each other; unknown keys count 4 per token.
KEY_BYTES_PER_TOKEN = {"seqs": 8, "greedy_seqs": 8, "prompt_mask": 1, "greedy_prompt_mask": 1, "logprobs": 4,
                       "ref_logprobs": 4, "values": 4}
KEY_BYTES_PER_SEQUENCE = {"rewards": 4, "baseline_rewards": 4}


@dataclass(frozen=True)
class ReallocCost:
    """Moving one model's parameters from ``src`` to ``dst``."""

    total_bytes: int
    seconds: float
    method: str  # "planner" (schedule/realloc_plan.py) or "fast"


def exact_realloc(cfg: ModelConfig, src: Layout, dst: Layout, bytes_per_element: int, cluster: ClusterSpec,
                  adapters_only: bool = False) -> ReallocCost:
    """Bytes from the runtime's reallocation planner; seconds from its pieces over the cluster's links."""
    plan = plan_reallocation(cfg, src, dst, bytes_per_element=bytes_per_element, node_of=cluster.node_of,
                             adapters_only=adapters_only)
    sends = [(p.src_rank, p.dst_ranks, p.numel * bytes_per_element) for p in plan.pieces]
    return ReallocCost(plan.total_bytes, links_seconds(cluster, sends), "planner")


@lru_cache(maxsize=1024)
def _layer_template(cfg: ModelConfig, tp_src: int, tp_dst: int,
                    adapters_only: bool) -> tuple[dict[tuple[str, int, int], int], dict[str, int]]:
    """Per-group overlap elements: split[(where, t_src, t_dst)] and replicated[where] for one layer / the ends."""
    split: dict[tuple[str, int, int], int] = defaultdict(int)
    replicated: dict[str, int] = defaultdict(int)
    for spec in param_specs(cfg):
        if spec.where == "layer" and spec.layer != 0 or adapters_only and not is_adapter(cfg, spec.name):
            continue
        if spec.split_dim is None:
            replicated[spec.where] += spec.numel
            continue
        length = spec.shape[spec.split_dim]
        rest = spec.numel // length
        for a in range(tp_src):
            lo_a, hi_a = split_range(length, tp_src, a, spec.unit)
            for b in range(tp_dst):
                lo_b, hi_b = split_range(length, tp_dst, b, spec.unit)
                overlap = min(hi_a, hi_b) - max(lo_a, lo_b)
                if overlap > 0:
                    split[(spec.where, a, b)] += overlap * rest
    return dict(split), dict(replicated)


def _stage_overlaps(cfg: ModelConfig, pp_src: int, pp_dst: int) -> dict[tuple[int, int], dict[str, int]]:
    """{(src stage, dst stage): {"layer": common layers, "first": 0/1, "last": 0/1}} for overlapping stages."""
    src, dst = stage_layers(cfg, pp_src), stage_layers(cfg, pp_dst)
    out = {}
    for p1, (lo1, hi1) in enumerate(src):
        for p2, (lo2, hi2) in enumerate(dst):
            common = max(0, min(hi1, hi2) - max(lo1, lo2))
            first = int(p1 == 0 and p2 == 0)
            last = int(p1 == pp_src - 1 and p2 == pp_dst - 1)
            if common or first or last:
                out[(p1, p2)] = {"layer": common, "first": first, "last": last}
    return out


def fast_realloc(cfg: ModelConfig, src: Layout, dst: Layout, bytes_per_element: int, cluster: ClusterSpec,
                 adapters_only: bool = False) -> ReallocCost:
    """The planner's byte counts and sender choice, computed per (stage, TP chunk) rather than per parameter."""
    return _fast_realloc(cfg, src, dst, bytes_per_element, cluster, adapters_only)


@lru_cache(maxsize=65536)
def _fast_realloc(cfg: ModelConfig, src: Layout, dst: Layout, bytes_per_element: int, cluster: ClusterSpec,
                  adapters_only: bool) -> ReallocCost:
    s1, s2 = src.strategy, dst.strategy
    split, replicated = _layer_template(cfg, s1.tp, s2.tp, adapters_only)
    overlaps = _stage_overlaps(cfg, s1.pp, s2.pp)
    load: dict[int, int] = defaultdict(int)
    # (sender, src stage, src TP rank or None, dst stage, dst TP rank, node) -> receivers
    groups: dict[tuple[int, int, int | None, int, int, int], list[int]] = defaultdict(list)
    sizes: dict[tuple[int, int, int | None, int, int, int], int] = {}
    # Pieces: one per (src stage, src chunk or "replicated", dst stage, dst chunk); receivers are
    # the dst DP replicas that do not already hold it, grouped by node as the planner does.
    for (p1, p2), common in overlaps.items():
        for t2 in range(s2.tp):
            wanted: list[tuple[int | None, int]]  # (source TP rank, or None for the replicated part; elements)
            wanted = [(t1, sum(split.get((w, t1, t2), 0) * common[w] for w in ("layer", "first", "last")))
                      for t1 in range(s1.tp)]
            wanted.append((None, sum(replicated.get(w, 0) * common[w] for w in ("layer", "first", "last"))))
            for t1, numel in wanted:
                if numel <= 0:
                    continue
                if t1 is None:
                    holders = [src.rank_at(p1, d, t) for d in range(s1.dp) for t in range(s1.tp)]
                else:
                    holders = [src.rank_at(p1, d, t1) for d in range(s1.dp)]
                held = set(holders)
                receivers = [dst.rank_at(p2, d, t2) for d in range(s2.dp)]
                receivers = [r for r in receivers if r not in held]
                by_node: dict[int, list[int]] = defaultdict(list)
                for r in receivers:
                    by_node[cluster.node_of(r)].append(r)
                nbytes = numel * bytes_per_element
                for node, group in sorted(by_node.items()):
                    near = [h for h in holders if cluster.node_of(h) == node]
                    senders = sorted(near or holders, key=lambda h: (load[h], h))
                    chunks = contiguous_chunks(group, min(len(senders), len(group))) if near else [group]
                    for sender, chunk in zip(senders, chunks):
                        load[sender] += nbytes * len(chunk)
                        key = (sender, p1, t1, p2, t2, node)
                        groups[key].extend(chunk)
                        sizes[key] = nbytes
    sends = [(key[0], receivers, sizes[key]) for key, receivers in groups.items()]
    total = sum(sizes[key] * len(receivers) for key, receivers in groups.items())
    return ReallocCost(total, links_seconds(cluster, sends), "fast")


def zero3_gather_seconds(cfg: ModelConfig, layout: Layout, bytes_per_element: int, cluster: ClusterSpec) -> float:
    """Gathering full TP/PP shards out of a ZeRO-3 partition over the DP group (before a non-train MFC)."""
    s = layout.strategy
    if s.dp == 1:
        return 0.0
    params = max(stage_param_elements(cfg, s.tp, s.pp, s.ep))
    group = max(layout.dp_groups(), key=lambda g: g[-1] - g[0])
    return allgather_seconds(cluster, group, params * bytes_per_element)


def key_bytes(mfc: MFC, key: str) -> int:
    """Bytes of ``key`` for the whole batch that ``mfc`` consumes."""
    if key in KEY_BYTES_PER_SEQUENCE:
        return mfc.n_seqs * KEY_BYTES_PER_SEQUENCE[key]
    return mfc.n_seqs * mfc.seq_tokens * KEY_BYTES_PER_TOKEN.get(key, 4)


def data_transfer_seconds(producer: Layout, consumer: Layout, nbytes: int, cluster: ClusterSpec) -> float:
    """Moving ``nbytes`` of an MFC's outputs from ``producer``'s DP ranks to every rank of ``consumer``'s DP groups.

    Free when both layouts are the same (each DP rank already holds its share). Otherwise DP
    replica ``j`` of the consumer gets its share from producer replica ``j mod dp`` (the rank of
    its last stage and first TP chunk, where outputs land), broadcast to its TP and PP ranks.
    """
    if producer == consumer or nbytes <= 0:
        return 0.0
    sp, sc = producer.strategy, consumer.strategy
    sends = []
    for j in range(sc.dp):
        sender = producer.rank_at(sp.pp - 1, j % sp.dp, 0)
        receivers = tuple(consumer.rank_at(p, j, t) for p in range(sc.pp) for t in range(sc.tp))
        sends.append((sender, receivers, nbytes / sc.dp))
    return links_seconds(cluster, sends)
