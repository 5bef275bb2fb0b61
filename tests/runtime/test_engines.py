import pytest
import torch

from restage.config.sections import ModelSpec, OptimConfig
from restage.layout import Layout, ProcessGroups, Strategy
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _dp_engine(rank, world_size, zero_stage, micro_batches):
    from restage.runtime.store.zero_engines import build_engine

    layout = Layout.contiguous(0, Strategy(dp=world_size))
    groups = ProcessGroups(layout.all_groups(), singletons=True)
    spec = ModelSpec(path="-", trainable=True, zero_stage=zero_stage, optim=OptimConfig(lr=0.1, grad_clip=0.5))
    return build_engine(_model(), spec, layout, rank, groups, micro_batches=micro_batches, total_optimizer_steps=2)


def _whole_params(engine, zero_stage):
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return [p.detach().clone() for p in engine.module.parameters()]
    return [p.detach().clone() for p in engine.module.parameters()]


def _train_dp(rank, world_size, zero_stage):
    engine = _dp_engine(rank, world_size, zero_stage, micro_batches=1)
    for _ in range(2):
        x, y = _data(rank)
        loss = ((engine(x) - y) ** 2).mean()
        engine.backward(loss)
        engine.step()
    return _whole_params(engine, zero_stage)


def _reference(world_size, ranks=None):
    """Plain AdamW with clipping on the mean loss over the data of ``ranks`` (default: every rank)."""
    ranks = range(world_size) if ranks is None else ranks
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(2):
        opt.zero_grad()
        loss = sum(((model(x) - y) ** 2).mean() for x, y in map(_data, ranks)) / len(ranks)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_engine_over_dp_matches_plain_adamw_on_the_mean_gradient(zero_stage):
    results = spawn(_train_dp, 2, zero_stage, env={"DS_ACCELERATOR": "cpu"})
    expected = _reference(2)
    for params in results:
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_zero_one_or_two_over_one_dp_rank_runs_as_stage_zero_and_matches_plain_adamw():
    from restage.runtime.store.zero_engines import deepspeed_config

    spec = ModelSpec(path="-", trainable=True, zero_stage=2)
    assert deepspeed_config(spec, dp=1, micro_batches=1)["zero_optimization"]["stage"] == 0
    assert deepspeed_config(spec, dp=2, micro_batches=1)["zero_optimization"]["stage"] == 2
    offloaded = ModelSpec(path="-", trainable=True, zero_stage=2, offload_optimizer=True)
    assert deepspeed_config(offloaded, dp=1, micro_batches=1)["zero_optimization"]["stage"] == 2  # offload needs ZeRO
    (params,) = spawn(_train_dp, 1, 1, env={"DS_ACCELERATOR": "cpu"})
    for got, want in zip(params, _reference(1)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _one_rank_engine_beside_a_dp2_engine(rank, world_size):
    from restage.runtime.store.zero_engines import build_engine, engine_groups

    groups = ProcessGroups([(0, 1)], singletons=True)
    spec = ModelSpec(path="-", trainable=True, zero_stage=1, optim=OptimConfig(lr=0.1, grad_clip=0.5))
    alone = build_engine(_model(), spec, Layout((rank,), Strategy()), rank, groups, micro_batches=1, total_optimizer_steps=2)
    # Built last, this engine's layout becomes DeepSpeed's global mpu.
    build_engine(_model(), spec, Layout.contiguous(0, Strategy(dp=2)), rank, groups, micro_batches=1, total_optimizer_steps=2)
    with engine_groups(alone):
        for _ in range(2):
            x, y = _data(rank)
            alone.backward(((alone(x) - y) ** 2).mean())
            alone.step()
    return [p.detach().clone() for p in alone.module.parameters()]


def test_an_engine_reduces_over_its_own_layout_when_another_engine_was_built_last():
    # Unpointed, DeepSpeed's ZeRO-0 all-reduce used the dp2 engine's group and averaged the two ranks' gradients.
    results = spawn(_one_rank_engine_beside_a_dp2_engine, 2, env={"DS_ACCELERATOR": "cpu"})
    for rank, params in enumerate(results):
        for got, want in zip(params, _reference(1, ranks=[rank])):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _forward_syncs_after_three_steps(rank, world_size):
    from deepspeed.accelerator import get_accelerator

    from restage.runtime.store.zero_engines import build_engine

    spec = ModelSpec(path="-", trainable=True, optim=OptimConfig(lr=0.1))
    engine = build_engine(_model(), spec, Layout((0,), Strategy()), rank, ProcessGroups([], singletons=True), micro_batches=1,
                          total_optimizer_steps=4)
    for _ in range(3):
        x, y = _data(rank)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
    accelerator, calls = get_accelerator(), []
    original = accelerator.synchronize
    accelerator.synchronize = lambda *args: calls.append(args) or original(*args)
    with torch.no_grad():
        engine.module(_data(rank)[0])  # how generation and inference call a model in its training layout
    return len(calls)


def test_a_forward_through_an_engines_module_does_not_synchronize_the_device():
    # DeepSpeed's throughput timer would (once per forward from the third step on); it is off in our config.
    assert spawn(_forward_syncs_after_three_steps, 1, env={"DS_ACCELERATOR": "cpu"}) == [0]


def _train_dp_two_micro_batches(rank, world_size, zero_stage):
    """As the pipeline trains: ``engine.module`` called directly (never ``engine.forward``), each micro-batch's
    backward through ``execute.stage_backward``, the boundary set by hand, one step per two micro-batches."""
    from restage.runtime.step.execute import stage_backward

    engine = _dp_engine(rank, world_size, zero_stage, micro_batches=2)
    for _ in range(2):
        x, y = _data(rank)
        for micro in range(2):
            part = slice(2 * micro, 2 * micro + 2)
            engine.set_gradient_accumulation_boundary(micro == 1)
            stage_backward(engine, ((engine.module(x[part]) - y[part]) ** 2).mean(), None)
        engine.step()
    return _whole_params(engine, zero_stage)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_accumulated_micro_batches_match_plain_adamw_on_the_mean_gradient(zero_stage):
    # Before: ZeRO-3 counts micro-steps in engine.forward, which the pipeline never calls, so each micro-batch's
    # gradient partition overwrote the last one's and only the second half of every rank's data trained.
    results = spawn(_train_dp_two_micro_batches, 2, zero_stage, env={"DS_ACCELERATOR": "cpu"})
    expected = _reference(2)  # equal halves: the mean of their mean losses is the whole batch's
    for params in results:
        for got, want in zip(params, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
