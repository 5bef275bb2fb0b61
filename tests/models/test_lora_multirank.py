"""LoRA on 2 ranks (CPU, gloo), one launch: TP=2 forward and adapter gradients equal one rank's; reallocation into
a copy that holds the base moves exactly the adapter bytes it lacks; DeepSpeed ZeRO 0-3 train only the adapters."""

from __future__ import annotations

import pytest
import torch

from restage.layout import Layout, ProcessGroups, Strategy
from restage.models.arch import LoraConfig
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q", "k", "v", "o", "gate", "up", "down"))
SEQS = [[5, 9, 3, 17, 40, 2, 8], [11, 250, 7, 7, 30]]
TP2, DP2 = Layout.contiguous(0, Strategy(tp=2)), Layout.contiguous(0, Strategy(dp=2))
RANK0, RANK1 = Layout((0,), Strategy()), Layout((1,), Strategy())


def _random_adapters(module) -> None:
    """Nonzero B (and A) from full tensors seeded by name, sliced to this rank's shard: every layout agrees."""
    import zlib

    from restage.models.sharding import shard_specs

    ctx = module.ctx
    shards = {s.param.name: s for s in shard_specs(module.cfg, Strategy(tp=ctx.tp_size, pp=ctx.pp_size), ctx.pp_stage,
                                                   ctx.tp_rank)}
    with torch.no_grad():
        for name, param in module.named_parameters():
            if ".lora_" in name:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1)
                full = torch.randn(shards[name].param.shape, generator=g) * 0.1
                param.copy_(full[shards[name].index()])


def _forward_backward(module):
    """Full-vocabulary logits and every adapter's full gradient (gathered over TP)."""
    from restage.models.hf_checkpoint import gather_full
    from restage.models.packing import pack
    from restage.models.parallel import gather_from_tp, vocab_sizes
    from restage.models.sharding import shard_specs

    tokens, batch = pack(SEQS)
    logits = module(tokens, batch)
    weights = torch.randn(logits.shape[0], module.cfg.vocab_size, generator=torch.Generator().manual_seed(3))
    lo = module.vocab_start
    (logits * weights[:, lo: lo + logits.shape[1]]).sum().backward()
    ctx = module.ctx
    full_logits = gather_from_tp(logits.detach(), ctx, vocab_sizes(module.cfg.vocab_size, ctx))
    shards = {s.param.name: s for s in shard_specs(module.cfg, Strategy(tp=ctx.tp_size), 0, ctx.tp_rank)}
    grads = {n: gather_full(p.grad, shards[n], ctx) for n, p in module.named_parameters() if p.requires_grad}
    return full_logits, grads


def _ranks(rank: int, world_size: int, path: str) -> dict:
    from restage.config.sections import ModelSpec, OptimConfig
    from restage.models.hf_checkpoint import load_stage
    from restage.models.sharding import is_adapter
    from restage.runtime.dataplane.realloc import execute_reallocation, groups_for
    from restage.runtime.store.zero_engines import build_engine
    from restage.schedule.realloc_plan import destination_shard_bytes, plan_reallocation

    out: dict = {}
    single = load_stage(path, Layout((rank,), Strategy()), None, rank, lora=LORA)
    cfg = single.cfg
    plans = [plan_reallocation(cfg, TP2, DP2, bytes_per_element=4, adapters_only=a) for a in (False, True)]
    plans += [plan_reallocation(cfg, RANK0, RANK1, bytes_per_element=4, adapters_only=a) for a in (False, True)]
    groups = ProcessGroups(groups_for(*plans) + TP2.all_groups() + DP2.all_groups(), singletons=True)

    # TP=2 against one rank: logits and adapter gradients.
    sharded = load_stage(path, TP2, groups, rank, lora=LORA)
    _random_adapters(single)
    _random_adapters(sharded)
    ref_logits, ref_grads = _forward_backward(single)
    logits, grads = _forward_backward(sharded)
    out["logit_error"] = float((logits - ref_logits).abs().max())
    # Relative to each gradient's largest entry: TP sums in another order (fp32).
    out["grad_error"] = max(float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()) for n in ref_grads)
    out["grad_names_match"] = grads.keys() == ref_grads.keys()
    out["base_has_no_grad"] = all(p.grad is None for n, p in sharded.named_parameters() if not is_adapter(cfg, n))

    # Reallocation tp2 -> dp2 and rank 0 -> rank 1: the first moves all, then only adapters into the copy.
    for name, (full_plan, adapter_plan), source in (("tp2_dp2", plans[:2], sharded), ("r0_r1", plans[2:], single)):
        first = execute_reallocation(full_plan, source if rank in full_plan.src else None, groups, dtype=torch.float32)
        again = execute_reallocation(adapter_plan, source if rank in adapter_plan.src else None, groups,
                                     dtype=torch.float32)
        out[name] = dict(first_received=first.stats.received_bytes, received=again.stats.received_bytes,
                         sent=again.stats.sent_bytes, keys=sorted(again.state),
                         adapter_shard_bytes=destination_shard_bytes(adapter_plan, rank),
                         local_bytes=sum(p.numel for p in adapter_plan.local_pieces if p.src_rank == rank) * 4,
                         plan_total=adapter_plan.total_bytes)

    # DeepSpeed over dp2 with every ZeRO stage: only the adapters are in the optimizer and change.
    for stage in (0, 1, 2, 3):
        module = load_stage(path, DP2, groups, rank, lora=LORA)
        before = {n: p.detach().clone() for n, p in module.named_parameters()}
        spec = ModelSpec(path="-", trainable=True, zero_stage=stage, optim=OptimConfig(lr=0.01))
        engine = build_engine(module, spec, DP2, rank, groups, micro_batches=1, total_optimizer_steps=1)
        from restage.models.packing import pack

        tokens, batch = pack(SEQS)
        loss = engine(tokens, batch).float().square().mean()
        engine.backward(loss)
        engine.step()
        optimized = sum(p.numel() if not hasattr(p, "ds_numel") else p.ds_numel
                        for group in engine.optimizer.param_groups for p in group["params"]) \
            if stage == 0 else None
        import contextlib

        import deepspeed

        params = list(engine.module.named_parameters())
        gathered = deepspeed.zero.GatheredParameters([p for _, p in params]) if stage == 3 else contextlib.nullcontext()
        with gathered:
            changed = sorted(n for n, p in params if not torch.equal(p.detach(), before[n]))
        out[f"zero{stage}"] = dict(changed=changed, optimized=optimized)
    out["adapter_names"] = sorted(n for n, _ in single.named_parameters() if is_adapter(cfg, n))
    out["adapter_elements"] = sum(p.numel() for n, p in single.named_parameters() if is_adapter(cfg, n))
    out["lora_B"] = sorted(n for n in out["adapter_names"] if "lora_B" in n)
    return out


def test_lora_tp_exactness_adapter_only_reallocation_and_zero_stages(tmp_path):
    from restage.models.tiny import build_tiny

    path = str(build_tiny(tmp_path / "llama", family="llama", seed=3))
    results = spawn(_ranks, 2, path, env={"DS_ACCELERATOR": "cpu"})
    for rank, r in enumerate(results):
        assert r["grad_names_match"] and r["base_has_no_grad"]
        assert r["logit_error"] < 1e-5 and r["grad_error"] < 1e-5, (r["logit_error"], r["grad_error"])
        # tp2 -> dp2: each rank receives its whole adapter shard but the part it held in tp2, and nothing else.
        t = r["tp2_dp2"]
        assert t["keys"] == r["adapter_names"]
        assert t["received"] == t["adapter_shard_bytes"] - t["local_bytes"] > 0
        assert t["first_received"] > 10 * t["received"]
        # rank 0 -> rank 1: rank 1 receives exactly the adapters' bytes.
        o = r["r0_r1"]
        if rank == 1:
            assert o["received"] == o["adapter_shard_bytes"] == r["adapter_elements"] * 4 == o["plan_total"]
        else:
            assert o["sent"] == r["adapter_elements"] * 4 and o["received"] == 0
        for stage in (0, 1, 2, 3):
            # One step from B = 0: only B has a gradient (A's is B^T dy = 0), so only B moves; the base stays.
            assert r[f"zero{stage}"]["changed"] == r["lora_B"], stage
        assert r["zero0"]["optimized"] == r["adapter_elements"]
    assert sum(r["tp2_dp2"]["received"] for r in results) == results[0]["tp2_dp2"]["plan_total"]
