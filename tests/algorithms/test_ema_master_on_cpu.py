"""A bf16 reference mixed by an EMA whose every step is under half a bf16 ulp still moves: the mix runs on an fp32
master (estimators.ema_master) and the reference is the master rounded."""

from __future__ import annotations

import torch

from restage.algorithms.estimators import ema_master, ema_mix_

ETA, STEPS = 0.01, 300


def _start() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ref = (torch.rand(1000, generator=gen) + 0.5).to(torch.bfloat16)  # weights in [0.5, 1.5)
    actor = (ref.float() + 0.05 * torch.randn(1000, generator=gen).sign()).to(torch.bfloat16)
    return ref, actor


def _fp64(ref: torch.Tensor, actor: torch.Tensor) -> torch.Tensor:
    out, target = ref.double(), actor.double()
    for _ in range(STEPS):
        out = out + ETA * (target - out)
    return out


def test_a_bf16_reference_moves_by_steps_under_half_an_ulp_as_fp64_says():
    ref, actor = _start()
    start = ref.clone()
    half_ulp = torch.finfo(torch.bfloat16).eps / 2 * start.double().abs()  # relative: at least half an ulp
    assert bool(((ETA * (actor.double() - start.double())).abs() < half_ulp).all())  # every step rounds away alone
    master = ema_master(ref)
    assert master is not None and master.dtype == torch.float32 and torch.equal(master, ref.float())
    for _ in range(STEPS):
        ema_mix_(ref, actor, ETA, master)
    expected = _fp64(start, actor)
    assert ref.dtype == torch.bfloat16 and bool((ref != start).all())  # every weight moved
    # the reference is the fp64 value rounded to bf16 (half an ulp of the result), give or take fp32's error
    ulp = torch.finfo(torch.bfloat16).eps * 2.0 ** torch.floor(torch.log2(expected.abs()))
    assert bool(((ref.double() - expected).abs() <= ulp / 2 + 1e-5).all())
    assert torch.equal(ref, master.to(torch.bfloat16))


def test_an_fp32_reference_is_its_own_master_and_mixes_as_before():
    ref, actor = (t.float() for t in _start())
    assert ema_master(ref) is None
    expected = ref.clone().lerp_(actor, ETA)
    assert torch.equal(ema_mix_(ref, actor, ETA), expected)
