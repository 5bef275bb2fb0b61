import math

import pytest
import torch

from restage.algorithms import losses, packed_ops


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_token_logprobs_and_entropy_are_aligned_to_the_token_they_score():
    torch.manual_seed(0)
    logits = torch.randn(5, 4)
    ids = torch.tensor([1, 3, 0, 2, 2])
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    lp = packed_ops.token_logprobs(logits, ids, cu)
    logsm = torch.log_softmax(logits, -1)
    want = [0.0, logsm[0, 3], logsm[1, 0], 0.0, logsm[3, 2]]
    assert lp.tolist() == pytest.approx([float(w) for w in want], abs=1e-6)
    ent = packed_ops.token_entropy(logits, cu)
    assert float(ent[4]) == pytest.approx(float(-(logsm[3].exp() * logsm[3]).sum()), abs=1e-6)
    assert float(ent[3]) == 0.0


def test_sft_loss_is_the_mean_nll_of_answer_tokens():
    lp = torch.tensor([0.0, -1.0, -2.0, 0.0, -4.0])
    mask = torch.tensor([False, False, True, False, True])
    assert float(losses.sft_loss(lp, mask)) == pytest.approx(3.0)


def test_bradley_terry_loss_and_accuracy_by_hand():
    loss, acc = losses.bradley_terry(torch.tensor([2.0, 0.0, 1.0]), torch.tensor([1.0, 0.5, -1.0]))
    want = -(math.log(sig(1.0)) + math.log(sig(-0.5)) + math.log(sig(2.0))) / 3
    assert float(loss) == pytest.approx(want, abs=1e-6)
    assert float(acc) == pytest.approx(2 / 3)


def test_dpo_log_ratio_and_ipo_by_hand():
    pi_c, pi_r = torch.tensor([-3.0, -5.0]), torch.tensor([-4.0, -2.0])
    ref_c, ref_r = torch.tensor([-3.5, -4.0]), torch.tensor([-3.0, -3.0])
    beta = 0.5
    loss, rc, rr = losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
    # h = (pi_c - ref_c) - (pi_r - ref_r): pair 0: 0.5 - (-1) = 1.5; pair 1: -1 - 1 = -2
    assert loss.tolist() == pytest.approx([-math.log(sig(0.75)), -math.log(sig(-1.0))], abs=1e-6)
    assert rc.tolist() == pytest.approx([0.25, -0.5]) and rr.tolist() == pytest.approx([-0.5, 0.5])
    ipo, _, _ = losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, "ipo")
    assert ipo.tolist() == pytest.approx([(1.5 - 1.0) ** 2, (-2 - 1.0) ** 2])
    smooth, _, _ = losses.dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, label_smoothing=0.1)
    assert float(smooth[0]) == pytest.approx(-0.9 * math.log(sig(0.75)) - 0.1 * math.log(sig(-0.75)), abs=1e-6)


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = [-0.5, 1.0]
    assert losses.kl_estimate(lp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    assert losses.kl_estimate(lp, ref, "k2").tolist() == pytest.approx([0.125, 0.5])
    assert losses.kl_estimate(lp, ref, "k3").tolist() == pytest.approx([math.exp(x) - x - 1 for x in d])


def test_policy_loss_clips_by_hand():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    mask = torch.tensor([False, True, True, True])
    old = torch.zeros(4)
    new = torch.tensor([0.0, math.log(1.5), math.log(0.5), math.log(1.1)])
    adv = torch.tensor([0.0, 1.0, -1.0, 2.0])
    loss, stats = losses.policy_loss(new, old, adv, mask, cu, clip_eps=0.2)
    # per token max(-A r, -A clip(r)): r=1.5,A=1 -> max(-1.5,-1.2)=-1.2; r=0.5,A=-1 -> max(0.5,0.8)=0.8; r=1.1,A=2 -> -2.2
    assert float(loss) == pytest.approx((-1.2 + 0.8 - 2.2) / 3, abs=1e-6)
    assert stats["clip_fraction"] == pytest.approx(2 / 3)
    assert stats["ratio_max"] == pytest.approx(1.5)
    assert stats["ratio_dev"] == pytest.approx((1.5 + 2.0 + 1.1) / 3)


def test_value_loss_clipping_by_hand():
    mask = torch.tensor([True, True, False])
    values, old, returns = torch.tensor([1.0, 0.0, 9.0]), torch.tensor([0.0, 0.0, 0.0]), torch.tensor([2.0, 1.0, 0.0])
    loss, frac = losses.value_loss(values, old, returns, mask, clip_eps=0.5)
    # token 0: v=1, clipped v=0.5 -> max((1-2)^2, (0.5-2)^2) = 2.25; token 1: v=0 -> 1.0
    assert float(loss) == pytest.approx(0.5 * (2.25 + 1.0) / 2)
    assert frac == pytest.approx(0.5)
    unclipped, frac = losses.value_loss(values, old, returns, mask, clip_eps=0.0)
    assert float(unclipped) == pytest.approx(0.5 * (1.0 + 1.0) / 2) and frac == 0.0


def test_seq_mean_aggregation_weights_sequences_equally():
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    mask = torch.tensor([False, True, True, False, True, True, True, True])
    x = torch.tensor([0.0, 1.0, 3.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert float(losses.aggregate(x, mask, cu, "seq_mean")) == pytest.approx((2.0 + 1.0) / 2)
    assert float(losses.aggregate(x, mask, cu, "token_mean")) == pytest.approx(8.0 / 6)


def test_masked_whiten_and_moments_with_a_reduce_over_shards():
    x, mask = torch.tensor([1.0, 2.0, 3.0, 100.0]), torch.tensor([True, True, True, False])
    w = packed_ops.masked_whiten(x, mask, eps=0.0)
    assert w.tolist() == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5), 0.0], abs=1e-6)
    # two shards whose "all-reduce" is the sum of both: the moments are those of the union
    other = (torch.tensor([5.0, 7.0]), torch.tensor([True, True]))
    def reduce(t):
        return t + torch.stack([(other[0] ** p * other[1]).sum().double() for p in (1, 2, 0)])
    mean, var, count = packed_ops.masked_moments(x, mask, reduce)
    union = torch.tensor([1.0, 2.0, 3.0, 5.0, 7.0], dtype=torch.float64)
    assert (float(mean), float(var), float(count)) == pytest.approx((float(union.mean()), float(union.var(unbiased=False)), 5))
