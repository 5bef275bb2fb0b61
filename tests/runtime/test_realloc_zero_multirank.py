"""Reallocation out of DeepSpeed ZeRO-1/2/3 engines (CPU, gloo) gives the same bits as plain shards."""

from __future__ import annotations

import pytest
import torch
from realloc_cases import L, module_from_state, reference_state, shard_of, tiny

from restage.config.sections import ModelSpec, OptimConfig
from restage.layout import ProcessGroups
from restage.models.sharding import shard_specs
from restage.runtime.control.spawn import spawn
from restage.runtime.dataplane.realloc import execute_reallocation, groups_for
from restage.schedule.realloc_plan import plan_reallocation

pytestmark = pytest.mark.multirank

SOURCES = [L(range(4), dp=2, tp=2), L(range(4), dp=4)]
# Ranks 2 and 3 only receive. Not with ZeRO-3: DeepSpeed 0.19.8's stage-3 set-up calls a barrier
# on the whole world, so an engine over part of the world needs every rank to build one.
PARTIAL = L((0, 1), dp=2)


def _sources(zero_stage: int) -> list:
    return SOURCES + ([PARTIAL] if zero_stage < 3 else [])
DESTINATIONS = [L(range(3), tp=3), L(range(4), tp=2, pp=2), L((2, 3), dp=2)]


def _from_engines(rank: int, world_size: int) -> list[dict]:
    from restage.runtime.store.zero_engines import build_engine

    cfg = tiny()
    full = reference_state(cfg, seed=7)
    plans = [plan_reallocation(cfg, s, d, bytes_per_element=4) for s in SOURCES + [PARTIAL] for d in DESTINATIONS]
    groups = ProcessGroups(groups_for(*plans) + [g for s in SOURCES + [PARTIAL] for g in s.all_groups()], singletons=True)
    out = []
    for zero_stage in (1, 2, 3):
        for src in _sources(zero_stage):
            spec = ModelSpec(path="-", trainable=True, zero_stage=zero_stage, optim=OptimConfig(lr=0.1))
            engine = build_engine(module_from_state(shard_of(cfg, src, rank, full)), spec, src, rank, groups,
                                  micro_batches=1, total_optimizer_steps=1) if rank in src else None
            for dst in DESTINATIONS:
                plan = plan_reallocation(cfg, src, dst, bytes_per_element=4)
                got = execute_reallocation(plan, engine, groups, dtype=torch.float32, bucket_bytes=8192)
                expected = shard_of(cfg, dst, rank, full)
                # share_local: ZeRO-1/2 tensors held whole are the engine's own; ZeRO-3's are copied (gathered, then released).
                shared = execute_reallocation(plan, engine, groups, dtype=torch.float32, bucket_bytes=8192, share_local=True)
                params = dict(engine.module.named_parameters()) if engine is not None else {}
                whole = [p for p in plan.local_pieces if p.src_rank == rank and p.whole]
                coord = src.coord(rank) or src.coord(src.mesh[0])  # a receiving-only rank: any source shard's size
                units = {}
                for s in shard_specs(cfg, src.strategy, coord.pp, coord.tp):
                    unit = 0 if s.param.layer is None and s.param.where == "first" else (
                        1 + s.param.layer if s.param.layer is not None else cfg.num_layers + 1)
                    units[unit] = units.get(unit, 0) + s.numel * 4
                out.append(dict(
                    zero_stage=zero_stage, src=str(src), dst=str(dst), source=rank in src,
                    wrong=[n for n, t in expected.items() if not torch.equal(got.state.get(n), t)],
                    keys_match=got.state.keys() == expected.keys(),
                    gathered=got.stats.peak_gathered_bytes, largest_unit=max(units.values()),
                    shard=sum(units.values()),
                    shared_wrong=[n for n, t in expected.items() if not torch.equal(shared.state.get(n), t)],
                    shared_bytes=shared.stats.shared_bytes, whole_bytes=sum(p.numel for p in whole) * 4,
                    aliases=sorted(n for n, t in shared.state.items()
                                   if n in params and t.data_ptr() == params[n].data_ptr()),
                    whole=sorted(p.name for p in whole),
                ))
            del engine
    return out


def test_zero_1_2_3_engines_are_sources_with_the_same_bits_as_plain_shards():
    results = spawn(_from_engines, 4, env={"DS_ACCELERATOR": "cpu"}, timeout_seconds=600)
    assert sum(r["shared_bytes"] > 0 for per_rank in results for r in per_rank) > 0
    for per_rank in results:
        assert len(per_rank) == sum(len(_sources(z)) for z in (1, 2, 3)) * len(DESTINATIONS)
        for r in per_rank:
            assert r["keys_match"] and r["wrong"] == [] and r["shared_wrong"] == [], r
            if r["zero_stage"] < 3:
                assert r["shared_bytes"] == r["whole_bytes"] and r["aliases"] == r["whole"], r
            else:
                assert r["shared_bytes"] == 0 and r["aliases"] == [], r
            if r["zero_stage"] == 3 and r["source"]:
                # Gathered one unit (embeddings, a layer, the head) at a time, never the whole shard.
                assert 0 < r["gathered"] <= r["largest_unit"] < r["shard"], r
            else:
                assert r["gathered"] == 0
