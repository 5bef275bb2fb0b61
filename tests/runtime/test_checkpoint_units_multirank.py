"""A ZeRO-3 model's HF export gathers one unit (embeddings, a layer, the head) at a time, never the whole stage, and
writes the bytes a plain (unpartitioned) save of the same weights writes."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

# MLP weights of 64 x 1600 = 102400 elements: above DeepSpeed's stage-3 persistence threshold (1e5), so they are
# really partitioned (smaller parameters stay whole on every rank and their gather moves nothing).
SIZES = dict(hidden_size=64, intermediate_size=1600, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=257)


def _save(rank: int, world_size: int, model_dir: str, out: str) -> dict:
    import deepspeed

    from restage.config.sections import ModelSpec, OptimConfig
    from restage.layout import Layout, ProcessGroups, Strategy
    from restage.models.hf_checkpoint import load_stage, save_checkpoint
    from restage.models.sharding import param_specs, unit_of
    from restage.runtime.checkpoint import run_state
    from restage.runtime.store.model_store import ModelSlot
    from restage.runtime.store.zero_engines import build_engine
    from restage.schedule.model_entry import ModelEntry

    layout = Layout((0, 1), Strategy(dp=2))
    groups = ProcessGroups(layout.all_groups(), singletons=True)
    module = load_stage(model_dir, layout, groups, rank)
    torch.manual_seed(5)  # the same moved weights on both ranks: not only the loaded ones
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    spec = ModelSpec(path=model_dir, trainable=True, zero_stage=3, optim=OptimConfig(lr=0.01))
    engine = build_engine(module, spec, layout, rank, groups, micro_batches=1, total_optimizer_steps=1)

    original = deepspeed.zero.GatheredParameters
    seen = {"requested": 0, "peak_requested": 0, "peak_partitioned": 0, "gathers": 0}
    partitioned = [p for p in engine.module.parameters() if not p.ds_persist]

    @contextlib.contextmanager
    def recording(params, *args, **kwargs):
        numel = sum(p.ds_numel for p in params)
        with original(params, *args, **kwargs):
            seen["gathers"] += 1
            seen["requested"] += numel
            seen["peak_requested"] = max(seen["peak_requested"], seen["requested"])
            # what the partitioned parameters really hold now (a released one holds no elements)
            seen["peak_partitioned"] = max(seen["peak_partitioned"], sum(p.numel() for p in partitioned))
            try:
                yield
            finally:
                seen["requested"] -= numel

    deepspeed.zero.GatheredParameters = recording
    cfg = engine.module.cfg
    entry = ModelEntry(arch=cfg, path=model_dir, preset="", trainable=True, dtype="fp32", zero_stage=3,
                       gradient_checkpointing=False, offload_optimizer=False, offload_params=False,
                       offload_when_idle=False, home_mfc="actor_train", home_layout=layout)
    slot = ModelSlot("actor", entry, cfg, module=engine.module, engine=engine)
    store = SimpleNamespace(slots={"actor": slot}, ema={}, device=torch.device("cpu"), rank=rank)
    run_state._write_models(Path(out) / "new", store, groups)  # type: ignore[arg-type]  # what save() calls
    deepspeed.zero.GatheredParameters = original

    # The previous export: the whole stage gathered, then saved.
    with original(list(engine.module.parameters())):
        save_checkpoint(engine.module, Path(out) / "whole")
    units: dict[int, int] = {}
    for s in param_specs(cfg):
        units[unit_of(cfg, s)] = units.get(unit_of(cfg, s), 0) + s.numel
    big = {n for n, p in engine.module.named_parameters() if not p.ds_persist}
    big_units: dict[int, int] = {}
    for s in param_specs(cfg):
        if s.name in big:
            big_units[unit_of(cfg, s)] = big_units.get(unit_of(cfg, s), 0) + s.numel
    if rank == 0:  # a plain module with the same weights, saved without ZeRO
        plain = load_stage(model_dir, Layout((0,), Strategy()), None, 0)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                p.copy_(weights[n])
        save_checkpoint(plain, Path(out) / "plain")
    return dict(seen, largest_unit=max(units.values()), stage=sum(units.values()), units=len(units),
                largest_partitioned_unit=max(big_units.values()), partitioned=sum(big_units.values()))


def test_zero3_export_gathers_one_unit_at_a_time_and_writes_the_plain_bytes(tmp_path):
    from restage.models.tiny import build_tiny, load_hf

    model_dir = build_tiny(tmp_path / "model", **SIZES)
    results = spawn(_save, 2, str(model_dir), str(tmp_path / "out"), env={"DS_ACCELERATOR": "cpu"},
                    timeout_seconds=600)
    for r in results:
        # every rank gathers (the gather is collective), one unit at a time: the largest unit, not the stage
        assert r["gathers"] == r["units"] == SIZES["num_layers"] + 2, r
        assert r["peak_requested"] == r["largest_unit"] < r["stage"], r
        assert r["peak_partitioned"] == r["largest_partitioned_unit"] < r["partitioned"], r
    print(f"peak gathered elements: {results[0]['peak_requested']} (largest unit), stage {results[0]['stage']}")
    out = tmp_path / "out"
    for file in ("model.safetensors", "config.json"):
        new = (out / "new" / "actor" / "hf" / file).read_bytes()
        assert new == (out / "whole" / file).read_bytes() == (out / "plain" / file).read_bytes(), file
    saved, plain = load_hf(out / "new" / "actor" / "hf").state_dict(), load_hf(out / "plain").state_dict()
    assert saved.keys() == plain.keys() and all(torch.equal(saved[k], plain[k]) for k in saved)
