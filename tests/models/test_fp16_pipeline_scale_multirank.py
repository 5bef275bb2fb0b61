"""fp16 under pp > 1: every stage's gradients carry the loss scale exactly once.

DeepSpeed's fp16 cannot run on a CPU, so the engine here is a stand-in whose ``backward`` does
what DeepSpeed's does (divide by the accumulation steps when asked, then scale the loss with
DeepSpeed's own ``ZeROOptimizer.scale_if_loss``); ``stage_backward`` is the runtime's code.
"""

from __future__ import annotations

import pytest
from test_train_1f1b_multirank import make_loss, micro_batches

from restage.layout import Layout, Strategy
from restage.models.sharding import shard_specs
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

LOSS_SCALE = 2.0 ** 10
MODEL = "llama"


class _Scaler:
    def __init__(self, scale: float):
        self.loss_scale = scale

    def scale_loss(self, loss):
        return loss * self.loss_scale


def fp16_like_engine(n_micro: int, scale: float = LOSS_SCALE):
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    class Optimizer(ZeROOptimizer):
        def __init__(self):
            super().__init__()
            self.custom_loss_scaler, self.torch_autocast_gradscaler, self.loss_scaler = False, None, _Scaler(scale)

    class Engine:
        optimizer = Optimizer()

        def gradient_accumulation_steps(self):
            return n_micro

        def backward(self, loss, scale_wrt_gas=True):
            loss = loss / n_micro if scale_wrt_gas else loss
            self.optimizer.scale_if_loss(loss).backward()

    return Engine()


def _grads(module, n_micro):
    from restage.models.pipeline import train_1f1b
    from restage.runtime.step.execute import stage_backward

    engine = fp16_like_engine(n_micro)
    mbs = micro_batches()
    # The loss is not divided by the micro-batches here: the engine's backward does it (scale_wrt_gas).
    train_1f1b(module, mbs, make_loss(module, 1), lambda tensor, grad: stage_backward(engine, tensor, grad))
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def _pipeline(rank, world_size, path):
    from restage.layout import ProcessGroups
    from restage.models.hf_checkpoint import load_stage

    layout = Layout(tuple(range(world_size)), Strategy(pp=world_size))
    groups = ProcessGroups(layout.all_groups())
    return _grads(load_stage(path, layout, groups, rank), len(micro_batches()))


def test_engine_stand_in_scales_like_deepspeed():
    from restage.runtime.step.execute import loss_scale_factor

    assert loss_scale_factor(fp16_like_engine(4)) == LOSS_SCALE
    assert loss_scale_factor(fp16_like_engine(4, scale=1.0)) == 1.0


def test_fp16_pp2_gradients_are_scaled_once(tiny_models):
    from restage.models.arch import ModelConfig
    from restage.models.hf_checkpoint import load_stage

    path = tiny_models[MODEL]
    single = _grads(load_stage(path, Layout((0,), Strategy()), None, 0), len(micro_batches()))
    per_stage = spawn(_pipeline, 2, path, timeout_seconds=300)
    cfg = ModelConfig.from_pretrained(path)
    checked = 0
    for stage, grads in enumerate(per_stage):
        shards = {s.param.name: s for s in shard_specs(cfg, Strategy(pp=2), stage, 0)}
        assert grads.keys() == shards.keys()
        for name, grad in grads.items():
            expected = single[name][shards[name].index()]
            if expected.norm() < 1e-3:
                continue
            ratio = (grad.norm() / expected.norm()).item()
            assert ratio == pytest.approx(1.0, rel=1e-4), f"stage {stage} {name}: gradient / single-rank = {ratio:.4g}"
            checked += 1
    assert checked >= 8
