"""Every tiny model under (tp, pp) in {(1,1), (2,1), (1,2), (2,2)} on 4 real gloo ranks, against transformers.

One spawn runs everything (loading, pipelined forward, greedy generation, the byte count of a
tp=2/pp=2 load, and a save from tp=2/pp=2); the tests below check its results.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from model_cases import CAUSAL, CRITICS, MICRO_BATCHES, PROMPTS, hf_greedy, hf_outputs

from restage.layout import Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

STRATEGIES = {(1, 1): Strategy(dp=4), (2, 1): Strategy(dp=2, tp=2), (1, 2): Strategy(dp=2, pp=2),
              (2, 2): Strategy(tp=2, pp=2)}
GENERATE = ["llama", "mistral", "qwen2_tied", "gpt2", "qwen3", "qwen3_tied", "llama31", "mixtral", "qwen3_moe"]
SAVE = ["qwen2_tied", "gpt2", "llama_critic", "qwen3", "qwen3_critic", "llama31", "mixtral", "qwen3_moe"]
NEW_TOKENS = 32
STATIC_DECODE = [(1, 1), (2, 1)]  # dp=4 and dp=2 x tp=2


def _run_layouts(rank, world_size, paths, save_root):
    from restage.layout import Layout, ProcessGroups
    from restage.models.arch import ModelConfig
    from restage.models.decoder import StageModule
    from restage.models.hf_checkpoint import load_checkpoint, load_stage, save_checkpoint
    from restage.models.packing import pack
    from restage.models.parallel import ParallelContext, gather_from_tp, vocab_sizes
    from restage.models.pipeline import MicroBatch, pipeline_forward
    from restage.models.sharding import shard_bytes
    from restage.rollout.budget import RolloutLimits
    from restage.rollout.engine import RolloutEngine
    from restage.rollout.generation import generate
    from restage.rollout.sampling import SamplingParams, request_keys

    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in STRATEGIES.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    micro_batches = [MicroBatch(*pack(seqs)) for seqs in MICRO_BATCHES]
    out = {"outputs": {}, "generated": {}, "bytes": {}, "qwen3_bytes": {}, "static": {}}
    for key, layout in layouts.items():
        coord = layout.coord(rank)
        for name, path in paths.items():
            module = load_stage(path, layout, groups, rank)
            ctx = module.ctx

            def full(output, mb, ctx=ctx, module=module):
                if module.cfg.is_critic:
                    return output
                # Logprobs and entropy from the vocabulary shards, then the gathered logits to compare.
                logprobs = module.token_logprobs(output, mb.tokens, mb.batch)
                entropy = module.token_entropy(output)
                logits = gather_from_tp(output, ctx, vocab_sizes(module.cfg.vocab_size, ctx))
                return torch.cat([logits, logprobs[:, None], entropy[:, None]], dim=1)

            outputs = pipeline_forward(module, micro_batches, post_fn=full)
            if outputs is not None and coord.tp == 0 and coord.dp == 0:
                out["outputs"][(name, key)] = torch.cat(outputs)
            if name in GENERATE:
                gen = generate(module, PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True, eos_token_ids=()))
                if coord.dp == 0:  # every stage and TP rank of the replica returns the same tokens
                    out["generated"][(name, key, rank)] = gen.sequences()
            if name == "llama" and key in STATIC_DECODE:  # what a CUDA graph replays, against the eager steps
                params = SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.95, seed=5,
                                        eos_token_ids=(5, 17, 40, 99))
                prompt_of, caps = [r // 3 for r in range(12)], [(r * 5) % 8 + 1 for r in range(12)]
                runs = [RolloutEngine(module, PROMPTS, prompt_of, caps, request_keys(range(12)), params, [],
                                      RolloutLimits(max_slots=4, check_every_steps=2), decode_mode=mode).run()
                        for mode in ("eager", "static")]
                out["static"][(key, rank)] = runs
            if key == (2, 2) and name in SAVE:
                save_checkpoint(module, Path(save_root) / name)
    # Bytes a tp=2, pp=2 rank reads, counted slice by slice.
    layout = layouts[(2, 2)]
    cfg = ModelConfig.from_pretrained(paths["llama"])
    module = StageModule(cfg, ParallelContext.from_layout(layout, groups, rank))
    reader = load_checkpoint(module, paths["llama"])
    coord = layout.coord(rank)
    out["bytes"][rank] = (reader.bytes_read, reader.total_bytes(), shard_bytes(cfg, layout.strategy, coord.pp, coord.tp, 4))
    cfg = ModelConfig.from_pretrained(paths["qwen3"])  # with the replicated q/k norms every rank reads whole
    reader = load_checkpoint(StageModule(cfg, ParallelContext.from_layout(layout, groups, rank)), paths["qwen3"])
    out["qwen3_bytes"][rank] = (reader.bytes_read, shard_bytes(cfg, layout.strategy, coord.pp, coord.tp, 4))
    return out


@pytest.fixture(scope="module")
def layout_results(tiny_models, tmp_path_factory):
    save_root = tmp_path_factory.mktemp("saved")
    merged = {"outputs": {}, "generated": {}, "bytes": {}, "qwen3_bytes": {}, "static": {}}
    for result in spawn(_run_layouts, 4, tiny_models, str(save_root), timeout_seconds=600):
        for kind, values in result.items():
            merged[kind].update(values)
    merged["save_root"] = save_root
    return merged


@pytest.mark.parametrize("name", CAUSAL)
def test_logits_equal_transformers_under_every_layout(layout_results, tiny_models, name):
    seqs = [s for mb in MICRO_BATCHES for s in mb]
    reference = torch.cat(hf_outputs(tiny_models[name], seqs))
    log_softmax = reference.log_softmax(-1)
    next_ids = torch.tensor([t for s in seqs for t in s[1:] + [0]])
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    ref_logprobs = log_softmax.gather(1, next_ids[:, None]).squeeze(1).index_fill(0, ends, 0.0)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    for key in STRATEGIES:
        ours = layout_results["outputs"][(name, key)]
        logits, logprobs, entropy = ours[:, :-2], ours[:, -2], ours[:, -1]
        assert logits.shape == reference.shape
        diff = (logits - reference).abs().max().item()
        assert diff <= 1e-4, f"{name} tp,pp={key}: max |logit diff| {diff:.2e}"
        assert (logprobs - ref_logprobs).abs().max().item() <= 1e-4, f"{name} tp,pp={key}: logprobs"
        assert (entropy - ref_entropy).abs().max().item() <= 1e-4, f"{name} tp,pp={key}: entropy"


@pytest.mark.parametrize("name", CRITICS)
def test_critic_values_equal_transformers_scores(layout_results, tiny_models, name):
    seqs = [s for mb in MICRO_BATCHES for s in mb]
    reference = torch.stack([score.reshape(-1)[-1] for score in hf_outputs(tiny_models[name], seqs)])
    ends = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
    for key in STRATEGIES:
        ours = layout_results["outputs"][(name, key)][ends]
        assert (ours - reference).abs().max().item() <= 1e-4, f"{name} tp,pp={key}"


@pytest.mark.parametrize("name", GENERATE)
def test_greedy_generation_is_token_identical_to_transformers(layout_results, tiny_models, name):
    reference = hf_greedy(tiny_models[name], PROMPTS, NEW_TOKENS)
    runs = {k: v for k, v in layout_results["generated"].items() if k[0] == name}
    assert {k[1] for k in runs} == set(STRATEGIES)
    for (_, key, rank), sequences in runs.items():
        assert all(len(s) == NEW_TOKENS for s in sequences)
        assert sequences == reference, f"{name} tp,pp={key} rank {rank}"


def test_static_decode_steps_give_the_eager_tokens_under_dp_and_tp(layout_results):
    """The static-buffer step (what decode_graphs captures on CUDA) equals the eager step on every rank."""
    runs = layout_results["static"]
    assert {key for key, _ in runs} == set(STATIC_DECODE) and len(runs) == 8
    for (key, rank), (eager, static) in runs.items():
        assert torch.equal(eager[0], static[0]) and torch.equal(eager[2], static[2]), f"tp,pp={key} rank {rank}"
        torch.testing.assert_close(eager[1], static[1], rtol=0, atol=1e-5)
        assert len(set(static[2].tolist())) >= 3  # answers of several lengths: slots refilled and buckets shrank
    for layout in STATIC_DECODE:  # every rank of a tp group, and every replica (same prompts, seeds), agrees
        assert len({tuple(static[0].flatten().tolist()) for (key, _), (_, static) in runs.items() if key == layout}) == 1


def test_a_tp2_pp2_rank_reads_about_a_quarter_of_the_weights(layout_results):
    for rank, (read, total, shard) in layout_results["bytes"].items():
        assert read == shard, f"rank {rank} read {read} bytes for a shard of {shard}"
        assert read <= 0.27 * total, f"rank {rank} read {read / total:.1%} of the checkpoint"


def test_a_tp2_pp2_rank_reads_only_its_qwen3_shard(layout_results):
    assert len(layout_results["qwen3_bytes"]) == 4
    for rank, (read, shard) in layout_results["qwen3_bytes"].items():
        assert read == shard, f"rank {rank} read {read} bytes for a shard of {shard}"


@pytest.mark.parametrize("name", SAVE)
def test_checkpoint_saved_from_tp2_pp2_loads_in_transformers_with_identical_logits(layout_results, tiny_models, name):
    saved = layout_results["save_root"] / name
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    from restage.models.tiny import load_hf

    ours, original = load_hf(saved).state_dict(), load_hf(tiny_models[name]).state_dict()
    assert ours.keys() == original.keys()
    assert all(torch.equal(ours[k], original[k]) for k in ours), "transformers loads different weights"
    # Bit-identical weights; the logits can still differ in the last bit because CPU matmul
    # kernels depend on the memory alignment of the (memory-mapped) weights.
    seqs = [s for mb in MICRO_BATCHES for s in mb]
    for mine, reference in zip(hf_outputs(str(saved), seqs), hf_outputs(tiny_models[name], seqs)):
        assert (mine - reference).abs().max().item() <= 1e-6
