"""A frozen model held 1/dp per rank (runtime/store/sharded_frozen.py) computes what the whole model computes.

Two gloo ranks under NCCL's rules, dp=2: each rank runs its own micro-batches through the whole model,
then loads the model sharded, unit by unit (``load_sharded``, as the runtime does), and runs them
again; the log-probs (values, for a critic) must agree within 1e-6. Between forwards the parameters
hold no storage and the slices hold 1/dp of each unit's (padded) bytes; during a forward no more than
one unit (two for a tied head on a first stage) is gathered at a time.
"""

from __future__ import annotations

import math

import pytest
from model_cases import MICRO_BATCHES, MODELS, sample_sequences

from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

NAMES = ("llama", "qwen2_tied", "gpt2", "llama_critic")


def _scorer(module):
    """The per-token log-probs of a causal LM's micro-batch, a critic's values as they are."""
    def score(output, mb):
        return output if module.cfg.is_critic else module.token_logprobs(output, mb.tokens, mb.batch)

    return score


def _run(rank, world_size, paths):
    import torch

    from restage.layout import Layout, ProcessGroups, Strategy
    from restage.models.hf_checkpoint import load_stage
    from restage.models.packing import pack
    from restage.models.pipeline import MicroBatch, pipeline_forward
    from restage.runtime.store.sharded_frozen import _units, load_sharded

    layout = Layout(tuple(range(world_size)), Strategy(dp=world_size))
    groups = ProcessGroups(layout.all_groups())
    # Each dp rank its own sequences, as a reference model's dp ranks score their own slices of the batch.
    seqs = MICRO_BATCHES if rank == 0 else [sample_sequences([11, 4], seed=9), sample_sequences([6], seed=10)]
    micro = [MicroBatch(*pack(s)) for s in seqs]
    out = {}
    for name, path in paths.items():
        module = load_stage(path, layout, groups, rank)
        module.requires_grad_(False)

        with torch.no_grad():
            whole = torch.cat(pipeline_forward(module, micro, post_fn=_scorer(module)))
        whole_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        unit_bytes = {u: sum(getattr(o, a).numel() * getattr(o, a).element_size() for o, a in owners)
                      for u, (_, owners) in _units(module).items()}
        critic = module.cfg.is_critic
        del module
        module, sharded = load_sharded(path, layout, groups, rank, torch.float32, torch.device("cpu"), critic)
        gathered_bytes: list[int] = []
        for _, (hooked, _) in _units(module).items():  # after the gathering hooks: what a unit's forward sees held
            hooked.register_forward_pre_hook(lambda *_, seen=gathered_bytes, module=module: seen.append(
                sum(p.numel() * p.element_size() for p in module.parameters())))
        held_before = sum(p.numel() * p.element_size() for p in module.parameters())
        with torch.no_grad():
            again = torch.cat(pipeline_forward(module, micro, post_fn=_scorer(module)))
        held_after = sum(p.numel() * p.element_size() for p in module.parameters())
        out[name] = {"diff": float((whole - again).abs().max()), "whole_bytes": whole_bytes, "unit_bytes": unit_bytes,
                     "shard_bytes": sharded.shard_bytes(), "held": (held_before, held_after),
                     "max_gathered_bytes": max(gathered_bytes), "tied": module.tied_head}
    return out


def test_sharded_frozen_model_scores_as_the_whole_one(tmp_path):
    from restage.models.tiny import build_tiny

    paths = {name: str(build_tiny(tmp_path / name, seed=i, **MODELS[name])) for i, name in enumerate(NAMES)}
    results = spawn(_run, 2, paths, timeout_seconds=600)
    for rank, result in enumerate(results):
        for name in NAMES:
            r = result[name]
            assert r["diff"] <= 1e-6, (rank, name, r["diff"])
            assert r["held"] == (0, 0), (rank, name)  # the parameters hold nothing between forwards
            # 1/dp of each unit's bytes, padded to a multiple of dp elements (4-byte fp32 elements)
            expected = sum(math.ceil(b / 4 / 2) * 4 for b in r["unit_bytes"].values())
            assert r["shard_bytes"] == expected, (rank, name)
            assert r["whole_bytes"] / 2 <= r["shard_bytes"] <= r["whole_bytes"] / 2 + 4 * len(r["unit_bytes"])
            largest = max(r["unit_bytes"].values())
            bound = max(largest, r["unit_bytes"]["embed"] + r["unit_bytes"]["head"]) if r["tied"] else largest
            assert r["max_gathered_bytes"] <= bound, (rank, name)
            assert r["max_gathered_bytes"] >= min(r["unit_bytes"].values())
