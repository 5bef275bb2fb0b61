"""1F1B training under (tp, pp) = (2, 2) and (1, 4) on 4 gloo ranks gives the single-rank gradients."""

from __future__ import annotations

import pytest
import torch
from model_cases import sample_sequences

from restage.layout import Layout, Strategy
from restage.models.sharding import shard_specs
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

STRATEGIES = {(2, 2): Strategy(tp=2, pp=2), (1, 4): Strategy(pp=4)}
# tied head copy, biases, fused GPT-2, value head, q/k norms, experts with the load-balancing loss (dense and sparse layers)
TRAIN = ["qwen2_tied", "gpt2", "llama_critic", "qwen3", "mixtral", "qwen3_moe"]


def micro_batches():
    from restage.models.packing import pack
    from restage.models.pipeline import MicroBatch

    out = []
    generator = torch.Generator().manual_seed(7)
    for i, lengths in enumerate([[9, 4], [12], [3, 6, 5], [10, 2]]):
        seqs = sample_sequences(lengths, seed=10 + i)
        tokens, batch = pack(seqs)
        targets = torch.cat([torch.tensor(s[1:] + [0]) for s in seqs])
        weights = torch.rand(tokens.numel(), generator=generator)
        weights[batch.last_token_index()] = 0.0  # no target after a sequence's last token
        returns = torch.randn(tokens.numel(), generator=generator)
        out.append(MicroBatch(tokens, batch, {"targets": targets, "weights": weights, "returns": returns}))
    return out


def make_loss(module, n_micro_batches: int):
    from restage.models.parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    def loss_fn(output, mb):
        if module.cfg.is_critic:
            loss = 0.5 * (output.float() - mb.extra["returns"]).pow(2).mean()
        else:
            logprobs = vocab_parallel_logprobs(output, mb.extra["targets"], module.ctx, module.vocab_start)
            entropy = vocab_parallel_entropy(output, module.ctx)
            loss = -(logprobs * mb.extra["weights"]).mean() - 0.01 * entropy.mean()
        return loss / n_micro_batches

    return loss_fn


def _train(rank, world_size, paths):
    from restage.layout import ProcessGroups
    from restage.models.hf_checkpoint import load_stage
    from restage.models.pipeline import train_1f1b

    layouts = {key: Layout(tuple(range(world_size)), s) for key, s in STRATEGIES.items()}
    groups = ProcessGroups([g for layout in layouts.values() for g in layout.all_groups()])
    mbs = micro_batches()
    out = {}
    for key, layout in layouts.items():
        for name in TRAIN:
            module = load_stage(paths[name], layout, groups, rank)
            losses = train_1f1b(module, mbs, make_loss(module, len(mbs)), aux_scale=1 / len(mbs))
            grads = {n: p.grad.clone() for n, p in module.named_parameters()}
            out[(name, key, rank)] = (grads, losses)
    return out


def reference(path):
    """Single-rank gradients and losses (tp = pp = 1, no torch.distributed)."""
    from restage.models.hf_checkpoint import load_stage
    from restage.models.pipeline import train_1f1b

    module = load_stage(path, Layout((0,), Strategy()), None, 0)
    mbs = micro_batches()
    losses = train_1f1b(module, mbs, make_loss(module, len(mbs)), aux_scale=1 / len(mbs))
    return {n: p.grad for n, p in module.named_parameters()}, losses


@pytest.fixture(scope="module")
def trained(tiny_models):
    merged = {}
    for result in spawn(_train, 4, {n: tiny_models[n] for n in TRAIN}, timeout_seconds=600):
        merged.update(result)
    return merged


@pytest.mark.parametrize("name", TRAIN)
def test_1f1b_gradients_equal_single_rank_gradients(trained, tiny_models, name):
    from restage.models.arch import ModelConfig

    cfg = ModelConfig.from_pretrained(tiny_models[name])
    ref_grads, ref_losses = reference(tiny_models[name])
    largest = max(g.norm() for g in ref_grads.values())
    for (model, key, rank), (grads, losses) in trained.items():
        if model != name:
            continue
        layout = Layout(tuple(range(4)), STRATEGIES[key])
        coord = layout.coord(rank)
        shards = {s.param.name: s for s in shard_specs(cfg, layout.strategy, coord.pp, coord.tp)}
        assert grads.keys() == shards.keys()
        for param, grad in grads.items():
            expected = ref_grads[param][shards[param].index()]
            if expected.norm() < 1e-6 * largest:
                # The key bias shifts every score of a query equally, so softmax cancels it: its
                # exact gradient is zero and both sides hold rounding noise only.
                assert grad.norm() < 1e-6 * largest, f"{name} tp,pp={key} rank {rank} {param}"
                continue
            error = (grad - expected).norm() / expected.norm()
            assert error <= 1e-5, f"{name} tp,pp={key} rank {rank} {param}: relative error {error:.2e}"
        if coord.pp == layout.strategy.pp - 1:
            assert torch.allclose(torch.stack(losses), torch.stack(ref_losses), rtol=1e-5, atol=0)
        else:
            assert losses is None
