"""DeepSpeed engines training a tiny Mixtral under expert parallelism, on 4 gloo ranks in one launch.

Ranks 0-1 train under dp2ep2 with ZeRO-1 while ranks 2-3 train under dp2ep2 with ZeRO-2 (two engines whose
expert groups DeepSpeed holds side by side), then all four train under dp2ep2pp2 with zero_stage 0 (which
runs as ZeRO-1 under ep). Every engine's parameters after each optimizer step equal one rank's plain AdamW
on the whole batch with the gradient clipped (the clip is set so it bites, which checks the norm over
experts on different ranks). The dp2ep2 engines save a checkpoint after step 1; fresh engines load it and
step again to the same parameters as the engines that never stopped.
"""

from __future__ import annotations

import pytest
import torch

from restage.config.sections import ModelSpec, OptimConfig
from restage.layout import Layout, Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

STEPS = 2
# Adam's step hardly depends on the gradient's scale, except where a gradient is near eps: an eps above the
# clipped gradients' rounding noise keeps that amplification out of the comparison; the norm is compared directly.
LR, CLIP, EPS = 1e-2, 0.05, 1e-6
ENGINES = {"dp2ep2 zero1": (Layout((0, 1), Strategy(dp=2, ep=2)), 1),
           "dp2ep2 zero2": (Layout((2, 3), Strategy(dp=2, ep=2)), 2),
           "dp2ep2pp2 zero0": (Layout((0, 1, 2, 3), Strategy(dp=2, pp=2, ep=2)), 0)}


def _sequences(step: int, replica: int) -> list[list[list[int]]]:
    """Replica ``replica``'s two micro-batches at optimizer step ``step``."""
    g = torch.Generator().manual_seed(100 * step + 10 * replica)
    return [[torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths] for lengths in ([9, 4], [3, 6, 5])]


def _micro_batches(seqs_list):
    from restage.models.packing import pack
    from restage.models.pipeline import MicroBatch

    return [MicroBatch(*pack(seqs)) for seqs in seqs_list]


def _loss(module, scale: float):
    def loss_fn(output, mb):
        logprobs = module.token_logprobs(output, mb.tokens, mb.batch)
        return (-logprobs.mean() - 0.01 * module.token_entropy(output).mean()) * scale

    return loss_fn


def _spec(zero_stage: int) -> ModelSpec:
    return ModelSpec(path="-", trainable=True, zero_stage=zero_stage, optim=OptimConfig(lr=LR, grad_clip=CLIP, eps=EPS))


def _engine(path, layout, zero_stage, groups, rank):
    from restage.models.hf_checkpoint import load_stage
    from restage.runtime.store.model_store import _mark_norm
    from restage.runtime.store.zero_engines import build_engine

    module = load_stage(path, layout, groups, rank)
    _mark_norm(module)
    return build_engine(module, _spec(zero_stage), layout, rank, groups, micro_batches=2, total_optimizer_steps=STEPS)


def _step(engine, step: int) -> tuple[dict[str, torch.Tensor], float]:
    """One optimizer step as ``runtime.step.execute.run_train`` takes it; returns the parameters after it and the
    gradient norm the engine clipped by."""
    from restage.models.pipeline import train_1f1b
    from restage.runtime.step.execute import stage_backward
    from restage.runtime.store.zero_engines import engine_groups

    module = engine.module
    micro = _micro_batches(_sequences(step, module.ctx.dp_rank))
    done = [0]

    def backward_fn(tensor, grad, stage_loss=None):
        engine.set_gradient_accumulation_boundary(done[0] == len(micro) - 1)
        stage_backward(engine, tensor, grad, stage_loss)
        done[0] += 1

    with engine_groups(engine):
        train_1f1b(module, micro, _loss(module, 1.0), backward_fn, sync_tied=False)
        engine.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}, float(engine.get_global_grad_norm())


def _checkpoint(engine, layout, groups, rank, directory, save: bool) -> None:
    from restage.runtime.checkpoint.run_state import ENGINE_TAG, _safe_engine_loads
    from restage.runtime.store.zero_engines import barriers_on, engine_groups

    with barriers_on(groups.get(layout.mesh)), engine_groups(engine):
        if save:
            engine.save_checkpoint(directory, tag=ENGINE_TAG, save_latest=False)
        else:
            with _safe_engine_loads(engine):
                loaded, _ = engine.load_checkpoint(directory, tag=ENGINE_TAG)
            assert loaded is not None


def _run(rank, world_size, path, checkpoints):
    from restage.layout import ProcessGroups

    groups = ProcessGroups([g for layout, _ in ENGINES.values() for g in layout.all_groups()], singletons=True)
    out: dict = {"params": {}, "norms": {}, "resumed": {}}
    for key, (layout, zero_stage) in ENGINES.items():
        if rank not in layout:
            continue
        engine = _engine(path, layout, zero_stage, groups, rank)
        directory = f"{checkpoints}/{key.replace(' ', '_')}"
        for step in range(1, STEPS + 1):
            out["params"][(key, step, rank)], out["norms"][(key, step, rank)] = _step(engine, step)
            if step == 1 and layout.size == 2:
                _checkpoint(engine, layout, groups, rank, directory, save=True)
        if layout.size == 2:
            fresh = _engine(path, layout, zero_stage, groups, rank)
            _checkpoint(fresh, layout, groups, rank, directory, save=False)
            after_load = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
            out["resumed"][(key, rank)] = (after_load, _step(fresh, STEPS)[0])
    return out


def _reference(path):
    """One rank, plain AdamW on the mean loss over both replicas' micro-batches, gradient clipped to CLIP."""
    from restage.models.hf_checkpoint import load_stage
    from restage.models.pipeline import train_1f1b

    module = load_stage(path, Layout((0,), Strategy()), None, 0)
    optim = OptimConfig(lr=LR, grad_clip=CLIP, eps=EPS)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=optim.betas, eps=optim.eps,
                            weight_decay=optim.weight_decay)
    params, norms = {}, {}
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        mbs = _micro_batches(_sequences(step, 0) + _sequences(step, 1))
        train_1f1b(module, mbs, _loss(module, 1 / len(mbs)), aux_scale=1 / len(mbs))
        norms[step] = float(torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP))
        opt.step()
        params[step] = {n: p.detach().clone() for n, p in module.named_parameters()}
    return params, norms


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from restage.models.tiny import build_tiny

    return str(build_tiny(tmp_path_factory.mktemp("moe") / "mixtral", seed=5, family="mixtral"))


@pytest.fixture(scope="module")
def results(mixtral, tmp_path_factory):
    checkpoints = str(tmp_path_factory.mktemp("engine_checkpoints"))
    merged: dict = {}
    for result in spawn(_run, 4, mixtral, checkpoints, timeout_seconds=600, env={"DS_ACCELERATOR": "cpu"}):
        for kind, values in result.items():
            merged.setdefault(kind, {}).update(values)
    return merged


@pytest.fixture(scope="module")
def reference(mixtral):
    return _reference(mixtral)


@pytest.mark.parametrize("key", list(ENGINES))
def test_engine_steps_under_ep_equal_one_rank_with_the_gradient_clipped(results, reference, mixtral, key):
    from restage.models.arch import ModelConfig
    from restage.models.sharding import coord_shard_specs

    ref_params, norms = reference
    assert all(norm > 4 * CLIP for norm in norms.values())  # the clip bites: the norm over all experts matters
    cfg = ModelConfig.from_pretrained(mixtral)
    layout, _ = ENGINES[key]
    worst = worst_norm = 0.0
    for step in range(1, STEPS + 1):
        for rank in layout.mesh:
            worst_norm = max(worst_norm, abs(results["norms"][(key, step, rank)] / norms[step] - 1))
            got = results["params"][(key, step, rank)]
            shards = {s.param.name: s for s in coord_shard_specs(cfg, layout.strategy, layout.coord(rank))}
            assert got.keys() == shards.keys() and any(".experts." in n for n in got) and len(got) < len(ref_params[1])
            for name, value in got.items():
                expected = ref_params[step][name][shards[name].index()]
                worst = max(worst, (value - expected).abs().max().item())
    print(f"{key}: worst |param - one rank| over {STEPS} steps {worst:.2e}, gradient norm relative error "
          f"{worst_norm:.2e} (one rank's norms {norms}, clipped to {CLIP})")
    assert worst <= 1e-5 and worst_norm <= 1e-5


@pytest.mark.parametrize("key", [k for k, (layout, _) in ENGINES.items() if layout.size == 2])
def test_engine_resumed_under_ep_restores_its_experts_and_optimizer_state(results, key):
    layout, _ = ENGINES[key]
    for rank in layout.mesh:
        after_load, after_step = results["resumed"][(key, rank)]
        saved, continued = results["params"][(key, 1, rank)], results["params"][(key, STEPS, rank)]
        assert after_load.keys() == saved.keys()
        assert all(torch.equal(after_load[n], saved[n]) for n in saved)  # each rank's own experts, not dp rank 0's
        # the second step from the loaded Adam moments equals the uninterrupted one's (fresh moments would not)
        assert all(torch.equal(after_step[n], continued[n]) for n in continued), f"{key} rank {rank}"
