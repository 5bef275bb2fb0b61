import math
import random

import pytest
import torch

from restage.algorithms import estimators
from restage.data.batch import pack_sequences


def reference_gae(rewards, values, mask, seqlens, gamma, lam):
    """Plain reverse loop, one sequence at a time, over its action tokens only."""
    adv, ret = [0.0] * len(rewards), [0.0] * len(rewards)
    start = 0
    for n in seqlens:
        actions = [t for t in range(start, start + n) if mask[t]]
        running, next_value = 0.0, 0.0
        for t in reversed(actions):
            delta = rewards[t] + gamma * next_value - values[t]
            running = delta + gamma * lam * running
            adv[t], ret[t] = running, running + values[t]
            next_value = values[t]
        start += n
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_matches_a_reverse_loop_over_packed_sequences(gamma, lam):
    rng = random.Random(0)
    seqlens = [5, 2, 7, 3, 9, 1]  # the last sequence is all prompt (no action)
    prompts = [2, 1, 3, 1, 4, 1]
    mask = [i >= p for n, p in zip(seqlens, prompts) for i in range(n)]
    mask[seqlens[0] + seqlens[1] + 4] = False  # a non-action token inside an answer is skipped, not a step
    rewards = [rng.uniform(-1, 1) if m else 0.0 for m in mask]
    values = [rng.uniform(-1, 1) if m else 0.0 for m in mask]
    cu = torch.tensor([0] + [sum(seqlens[:i + 1]) for i in range(len(seqlens))], dtype=torch.int32)
    adv, ret = estimators.gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), cu, gamma, lam)
    want_adv, want_ret = reference_gae(rewards, values, mask, seqlens, gamma, lam)
    assert adv.tolist() == pytest.approx(want_adv, abs=1e-5)
    assert ret.tolist() == pytest.approx(want_ret, abs=1e-5)


def test_gae_by_hand_on_one_short_sequence():
    # actions at t=1,2 with r=(0, 1), V=(0.5, 0.25), gamma=0.9, lam=0.5:
    # delta2 = 1 - 0.25 = 0.75; delta1 = 0 + 0.9*0.25 - 0.5 = -0.275; A1 = -0.275 + 0.45*0.75 = 0.0625
    adv, ret = estimators.gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.0, 0.5, 0.25]),
                              torch.tensor([False, True, True]), torch.tensor([0, 3], dtype=torch.int32), 0.9, 0.5)
    assert adv.tolist() == pytest.approx([0.0, 0.0625, 0.75])
    assert ret.tolist() == pytest.approx([0.0, 0.5625, 1.0])


def test_group_normalisation_by_hand():
    rewards = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    adv = estimators.group_normalise(rewards, 3, eps=0.0)
    # group 1: mean 2, unbiased std 1 -> (-1, 0, 1); group 2: no spread -> 0 (eps keeps it finite)
    assert adv[:3].tolist() == pytest.approx([-1.0, 0.0, 1.0])
    adv = estimators.group_normalise(rewards, 3, eps=1e-6)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]
    assert estimators.group_normalise(rewards, 2, use_std=False).tolist() == pytest.approx([-0.5, 0.5, -1.0, 1.0, 0, 0])
    with pytest.raises(ValueError, match="groups of 4"):
        estimators.group_normalise(rewards, 4)


def test_adaptive_kl_controller_update_by_hand():
    ctl = estimators.AdaptiveKLController(0.1, target=6.0, horizon=100.0)
    ctl.update(current_kl=9.0, n_steps=10)  # error = clip(9/6 - 1) = 0.2 (clipped from 0.5)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    ctl.update(current_kl=5.4, n_steps=20)  # error = -0.1
    assert ctl.value == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 20 / 100))
    restored = estimators.AdaptiveKLController(0.5, 6.0, 100.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = estimators.FixedKLController(0.3)
    fixed.update(100.0, 8)
    assert fixed.value == 0.3


def test_value_normaliser_tracks_all_data_seen_and_round_trips():
    torch.manual_seed(0)
    chunks = [torch.randn(50) * 3 + 2, torch.randn(30) * 0.5 - 1, torch.randn(70)]
    masks = [torch.rand(len(c)) > 0.3 for c in chunks]
    norm = estimators.ValueNormaliser(eps=0.0)
    for c, m in zip(chunks, masks):
        norm.update(c, m)
    seen = torch.cat([c[m] for c, m in zip(chunks, masks)]).double()
    assert norm.mean == pytest.approx(float(seen.mean()), rel=1e-9)
    assert norm.var == pytest.approx(float(seen.var(unbiased=False)), rel=1e-9)
    x = torch.tensor([0.0, 1.0, 5.0])
    assert norm.denormalise(norm.normalise(x)).tolist() == pytest.approx(x.tolist(), abs=1e-6)
    other = estimators.ValueNormaliser()
    other.load_state_dict(norm.state_dict())
    assert other.state_dict() == norm.state_dict()


def test_reward_shaping_and_kl_folded_into_the_last_action():
    assert estimators.shape_rewards(torch.tensor([3.0, -1.0]), scale=2.0, bias=1.0, clip=3.0).tolist() == [3.0, -3.0]
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    mask = torch.tensor([False, True, True, False, True])
    kl = torch.tensor([0.0, 0.5, -0.25, 0.0, 1.0])
    out = estimators.kl_shaped_token_rewards(torch.tensor([2.0, 7.0]), kl, mask, cu, kl_coef=0.1)
    assert out.tolist() == pytest.approx([0.0, -0.05, 2.025, 0.0, 6.9])
    rtg = estimators.returns_to_go(out, mask, cu)
    assert rtg.tolist() == pytest.approx([0.0, 1.975, 2.025, 0.0, 6.9])


def test_minibatches_cover_every_sample_once_per_epoch():
    batch = pack_sequences([[i] * (1 + i % 4) for i in range(22)], group_size=2, ids=range(11))
    seen = {}
    for epoch, _index, mb in estimators.minibatches(batch, n_minibatches=4, epochs=3, seed=5):
        seen.setdefault(epoch, []).append(list(mb.ids))
        # whole groups: both sequences of sample k hold token values 2k and 2k+1
        firsts = mb["seqs"][mb.cu_seqlens[:-1].long()].tolist()
        assert firsts == [v for k in mb.ids for v in (2 * k, 2 * k + 1)]
    assert sorted(seen) == [0, 1, 2]
    for parts in seen.values():
        assert sorted(i for p in parts for i in p) == list(range(11))
        assert sorted(len(p) for p in parts) == [2, 3, 3, 3]
    assert seen[0] != seen[1]  # reshuffled per epoch


def test_ema_mixing_rule():
    ref, actor = torch.tensor([1.0, 2.0]), torch.tensor([3.0, -2.0])
    estimators.ema_mix_(ref, actor, 0.25)
    assert ref.tolist() == pytest.approx([1.5, 1.0])
    assert math.isclose(float(estimators.ema_mix_(ref, actor, 1.0)[0]), 3.0)
