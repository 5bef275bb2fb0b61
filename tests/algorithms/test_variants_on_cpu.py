"""The registered algorithm variants (issue 31): advantages, losses, aggregations, DAPO's parts, IS correction."""

import dataclasses
import math

import pytest
import torch

from restage.algorithms import estimators, grpo, is_correction, losses, registry
from restage.algorithms.interface import build_graph, get_algorithm
from restage.config.load import config_from_dict
from restage.config.sections import PlanConfig
from restage.data.batch import Batch, pack_sequences
from restage.errors import ConfigError
from restage.graph import MFC, MFCOptions
from restage.runtime.step import dynamic_sampling
from restage.runtime.step.execute import MFCResult


def cfg(execution="sync", **algo):
    return config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": "sort",
                             "models": {"actor": {"path": "p"}, "ref": {"path": "p"}},
                             "generation": {"max_new_tokens": 8}, "plan": {"execution": execution},
                             "algo": {"group_size": 4, **algo}})


def inputs(group, lengths, **extra):
    seqs = [[1] * 2 + [5] * n for n in lengths]
    batch = pack_sequences(seqs, prompt_lens=[2] * len(lengths))
    mask = ~batch["prompt_mask"].bool()
    fields = {"token_kl": torch.zeros(batch.n_tokens), "kl_coef": 0.0, "eps": 1e-6} | extra
    return batch, registry.AdvantageInputs(group, mask, batch.cu_seqlens, **fields)


def per_seq(advantages, batch):
    return [float(a[~batch["prompt_mask"].bool()[s:e]][0]) for s, e, a in
            ((int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1]), advantages[batch.cu_seqlens[i]:batch.cu_seqlens[i + 1]])
             for i in range(batch.n_seqs))]


def test_rloo_is_the_reward_minus_the_mean_of_the_others_in_its_group():
    batch, ctx = inputs(3, [2, 3, 1, 2, 2, 2])
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 5.0])
    got = per_seq(registry.ADVANTAGES["rloo"](rewards, ctx), batch)
    assert got == pytest.approx([1 - 0.25, 0 - 0.75, 0.5 - 0.5, 2 - 3.5, 2 - 3.5, 5 - 2], abs=1e-6)


def test_dr_grpo_advantage_does_not_divide_by_the_group_std_and_grpo_does():
    batch, ctx = inputs(2, [2, 2, 2, 2])
    rewards = torch.tensor([1.0, 0.0, 10.0, 0.0])
    assert per_seq(registry.ADVANTAGES["dr_grpo"](rewards, ctx), batch) == pytest.approx([0.5, -0.5, 5.0, -5.0])
    std = [math.sqrt(0.5), math.sqrt(50)]
    assert per_seq(registry.ADVANTAGES["grpo"](rewards, ctx), batch) == pytest.approx(
        [0.5 / std[0], -0.5 / std[0], 5 / std[1], -5 / std[1]], rel=1e-5)


def test_reinforce_pp_whitens_over_the_whole_batch_and_the_baseline_variant_subtracts_the_group_mean_first():
    batch, ctx = inputs(2, [1, 1, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0])
    plain = per_seq(registry.ADVANTAGES["reinforce_pp"](rewards, ctx), batch)
    z = (torch.tensor([1.0, 0.0, 3.0, 2.0]) - 1.5) / torch.tensor([1.0, 0.0, 3.0, 2.0]).std(unbiased=False)
    assert plain == pytest.approx(z.tolist(), rel=1e-5)
    baseline = per_seq(registry.ADVANTAGES["reinforce_pp_baseline"](rewards, ctx), batch)
    assert baseline == pytest.approx([1.0, -1.0, 1.0, -1.0], rel=1e-5)  # (+-0.5) whitened: group means gone


def test_reinforce_pp_with_kl_in_reward_charges_each_token_the_kl_after_it():
    batch, ctx = inputs(1, [3, 3], token_kl=torch.tensor([0, 0, 1.0, 2.0, 3.0, 0, 0, 0.0, 0.0, 0.0]), kl_coef=0.5)
    rewards = torch.tensor([1.0, 1.0])
    mask = ctx.mask
    token_rewards = estimators.kl_shaped_token_rewards(rewards, ctx.token_kl, mask, batch.cu_seqlens, 0.5)
    returns = estimators.returns_to_go(token_rewards, mask, batch.cu_seqlens)
    assert returns[mask].tolist() == pytest.approx([1 - 3.0, 1 - 2.5, 1 - 1.5, 1, 1, 1])
    got = registry.ADVANTAGES["reinforce_pp"](rewards, ctx)[mask]
    assert got.tolist() == pytest.approx(((returns[mask] - returns[mask].mean()) /
                                          returns[mask].std(unbiased=False)).tolist(), rel=1e-5)


@pytest.mark.parametrize("advantage", ["rloo", "dr_grpo", "grpo"])
def test_rloo_and_the_group_estimators_with_kl_in_reward_charge_each_answer_its_summed_kl(advantage):
    # Two groups of two; the answers' KL sums are 6, 0 | 1, 3 (prompt tokens hold KL the mask must ignore).
    kl = torch.tensor([9.0, 9, 1, 2, 3, 9, 9, 0, 0, 9, 9, 1, 0, 9, 9, 1, 2, 0])
    batch, ctx = inputs(2, [3, 2, 2, 3], token_kl=kl, kl_coef=0.1)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    charged = rewards - 0.1 * torch.tensor([6.0, 0.0, 1.0, 3.0])
    _, plain = inputs(2, [3, 2, 2, 3])  # kl_coef 0: the KL is in the loss, not the reward
    got = per_seq(registry.ADVANTAGES[advantage](rewards, ctx), batch)
    assert got == pytest.approx(per_seq(registry.ADVANTAGES[advantage](charged, plain), batch), rel=1e-6)
    if advantage == "rloo":  # r_i - r_j in a group of two: 0.4 - 0, and 0.4 - 0.2
        assert got == pytest.approx([0.4, -0.4, 0.2, -0.2], rel=1e-6)


def test_aggregations_of_grpo_dapo_and_dr_grpo_on_one_batch():
    x = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 3.0, 3.0])
    mask = torch.tensor([False, True, True, False, True, True, True])
    cu = torch.tensor([0, 3, 7])
    agg = {name: float(losses.aggregate(x, mask, cu, name, norm_tokens=10)) for name in registry.AGGREGATIONS}
    assert agg == pytest.approx({"token_mean": 12 / 5, "seq_mean": (1.5 + 3) / 2, "seq_mean_token_sum": (3 + 9) / 2,
                                 "seq_mean_token_sum_norm": 12 / (2 * 10)})


def test_every_aggregation_with_the_steps_loss_norm_averages_over_micro_batches_to_the_whole_steps_value():
    """DeepSpeed averages the micro-batches' (and dp ranks') losses; with the step's ``LossNorm`` that average is the
    aggregation of the whole step, whatever the cut (here: one short answer, then three, one of them empty)."""
    x = torch.tensor([9.0, 1.0, 2.0, 9.0, 3.0, 3.0, 3.0, 9.0, 5.0, 9.0, 9.0, 7.0, 1.0, 4.0, 2.0])
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 3, 7, 9, 10, 15])  # the 4th sequence has no answer token
    whole = {name: float(losses.aggregate(x, mask, cu, name, norm_tokens=10)) for name in registry.AGGREGATIONS}
    cuts = [(0, 1), (1, 5)]  # micro-batches of sequences [0] and [1, 2, 3, 4]
    norm = registry.LossNorm(tokens=int(mask.sum()) / 2, seqs=5 / 2, answered_seqs=4 / 2)
    for name in registry.AGGREGATIONS:
        parts, unnormed = [], []
        for first, last in cuts:
            lo, hi = int(cu[first]), int(cu[last])
            args = (x[lo:hi], mask[lo:hi], cu[first:last + 1] - lo, name, 10)
            parts.append(float(losses.aggregate(*args, norm=norm)))
            unnormed.append(float(losses.aggregate(*args)))
        assert sum(parts) / 2 == pytest.approx(whole[name], rel=1e-6), name
        if name != "seq_mean_token_sum_norm":  # each micro-batch's own mean weighs the short one's tokens more
            assert sum(unnormed) / 2 != pytest.approx(whole[name], rel=1e-3), name
    # The critic's value loss: a token mean too.
    values, returns = x / 2, torch.zeros_like(x)
    loss_whole, _ = losses.value_loss(values, values, returns, mask, 0.0)
    halves = [losses.value_loss(values[int(cu[a]):int(cu[b])], values[int(cu[a]):int(cu[b])], returns[int(cu[a]):int(cu[b])],
                                mask[int(cu[a]):int(cu[b])], 0.0, norm)[0] for a, b in cuts]
    assert float(sum(halves)) / 2 == pytest.approx(float(loss_whole), rel=1e-6)


def test_dapo_decoupled_clip_clips_above_at_its_own_bound():
    logprobs = torch.log(torch.tensor([1.25, 1.25, 0.7, 0.85]))
    anchor = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = torch.ones(4, dtype=torch.bool)
    per_token, _ = registry.POLICY_LOSSES["ppo"](logprobs, anchor, adv, mask, torch.tensor([0, 4]), 0.2, 0.28)
    assert per_token.tolist() == pytest.approx([-1.25, -1.25, 0.8, 0.85], rel=1e-6)  # 0.7 clipped up to 1 - 0.2
    symmetric, _ = registry.POLICY_LOSSES["ppo"](logprobs, anchor, adv, mask, torch.tensor([0, 4]), 0.2, 0.2)
    assert symmetric.tolist() == pytest.approx([-1.2, -1.2, 0.8, 0.85], rel=1e-6)


def test_gspo_gives_every_token_of_a_sequence_one_ratio_and_one_gradient_through_the_mean():
    lp = torch.tensor([0.0, 0.1, 0.3, 0.0, -0.2]).requires_grad_(True)
    mask = torch.tensor([False, True, True, True, True])
    cu = torch.tensor([0, 3, 5])
    per_token, _ = registry.POLICY_LOSSES["gspo"](lp, torch.zeros(5), torch.tensor([0.0, 1, 1, -1, -1]), mask, cu,
                                                  1.0, 1.0)
    s = [math.exp(0.2), math.exp(-0.1)]
    assert per_token[mask].tolist() == pytest.approx([-s[0], -s[0], s[1], s[1]], rel=1e-6)
    per_token[mask].sum().backward()
    assert lp.grad.tolist() == pytest.approx([0, -s[0], -s[0], s[1], s[1]], rel=1e-6)  # 2 tokens x (1/2) d s / d lp


def test_dapo_overlong_penalty_is_zero_before_the_buffer_and_linear_to_the_cap():
    lengths = torch.tensor([3, 6, 7, 8, 9])
    got = grpo.overlong_penalty(lengths, 8, 4, 1.0)
    assert got.tolist() == pytest.approx([0.0, -0.5, -0.75, -1.0, -1.0])
    assert grpo.overlong_penalty(lengths, 8, 0, 1.0).tolist() == [0.0] * 5


def test_importance_sampling_weights_are_exactly_one_when_both_layouts_agree():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(50, generator=g) * 4
    mask = torch.rand(50, generator=g) > 0.3
    for mode in ("tis", "mis"):
        w, stats = is_correction.importance_weights(lp, lp.clone(), mask, mode, 2.0)
        assert torch.equal(w[mask], torch.ones(int(mask.sum()))) and torch.equal(w[~mask], torch.zeros(int((~mask).sum())))
        assert (stats["is_weight_mean"], stats["is_weight_max"], stats["is_weight_corrected"]) == (1.0, 1.0, 0.0)


def test_importance_sampling_truncates_or_masks_at_the_cap():
    train = torch.log(torch.tensor([3.0, 1.5, 0.25, 1.0]))
    mask = torch.tensor([True, True, True, False])
    tis, stats = is_correction.importance_weights(train, torch.zeros(4), mask, "tis", 2.0)
    assert tis.tolist() == pytest.approx([2.0, 1.5, 0.25, 0.0])
    mis, stats = is_correction.importance_weights(train, torch.zeros(4), mask, "mis", 2.0)
    assert mis.tolist() == pytest.approx([0.0, 1.5, 0.0, 0.0]) and stats["is_weight_corrected"] == pytest.approx(2 / 3)


def rl_batch(group=4):
    g = torch.Generator().manual_seed(1)
    seqs = [[1, 3] + torch.randint(3, 15, (2 + i % 3,), generator=g).tolist() for i in range(2 * group)]
    batch = pack_sequences(seqs, group_size=group, prompt_lens=[2] * (2 * group))
    answer = ~batch["prompt_mask"].bool()
    lp = -torch.rand(batch.n_tokens, generator=g) * answer
    return batch.with_keys(tokens={"logprobs": lp, "ref_logprobs": lp + 0.1 * answer},
                           seqs={"rewards": torch.arange(2.0 * group) % 3})


def test_importance_sampling_in_sync_mode_adds_actor_prox_and_equals_the_plain_loss_when_layouts_agree():
    c = cfg(is_correction="tis", kl_coef=0.0)
    graph = build_graph(c)
    assert graph["actor_prox"].outputs == ("prox_logprobs",) and "versions" not in graph["actor_gen"].outputs
    assert "prox_logprobs" in graph["actor_train"].inputs
    algo = get_algorithm("grpo")
    plain_cfg = cfg(kl_coef=0.0)
    prepared, _ = algo.prepare_train(rl_batch(), plain_cfg, algo.init_state(plain_cfg))
    new = prepared["logprobs"] + 0.3 * torch.randn(prepared.n_tokens, generator=torch.Generator().manual_seed(2))
    plain, _ = algo.loss("actor_train", prepared, {"logprobs": new}, plain_cfg, algo.init_state(plain_cfg))
    agree = prepared.with_keys(tokens={"prox_logprobs": prepared["logprobs"].clone()})
    corrected, stats = algo.loss("actor_train", agree, {"logprobs": new}, c, algo.init_state(c))
    assert torch.equal(plain, corrected) and stats["is_weight_mean"] == 1.0 and stats["is_weight_corrected"] == 0.0


def test_variant_config_keys_are_checked_against_the_registries():
    with pytest.raises(ConfigError, match="algo.advantage: 'rlooo' must be one of grpo, dr_grpo, rloo"):
        grpo.validate(cfg(advantage="rlooo"))
    with pytest.raises(ConfigError, match="algo.policy_loss"):
        grpo.validate(cfg(policy_loss="gsp"))
    with pytest.raises(ConfigError, match="algo.is_correction: 'x' must be one of none, tis, mis"):
        grpo.validate(cfg(is_correction="x"))
    assert grpo.validate(cfg("async", dynamic_sampling=True)).dynamic_sampling  # async fills batches too
    partial = dataclasses.replace(cfg("async", dynamic_sampling=True), plan=PlanConfig(
        execution="async", staleness=2, partial_rollouts=True))
    with pytest.raises(ConfigError, match=r"^algo.dynamic_sampling does not run with plan.partial_rollouts"):
        grpo.validate(partial)
    with pytest.raises(ConfigError, match="overlong_buffer: 8 must be below generation.max_new_tokens"):
        grpo.validate(cfg(overlong_buffer=8))


def fake_generate(reward_of, calls):
    """A generate stand-in: group answers of prompt id ``i`` score ``reward_of(i, seed, j)``."""

    def generate(prompts: Batch, seed: int) -> MFCResult:
        calls.append((list(prompts.ids), seed))
        seqs = [[1, 4, 5] for _ in prompts.ids for _ in range(4)]
        batch = pack_sequences(seqs, group_size=4, prompt_lens=[2] * len(seqs), ids=prompts.ids)
        rewards = torch.tensor([reward_of(int(i), seed, j) for i in prompts.ids for j in range(4)])
        return MFCResult(batch.with_keys(seqs={"rewards": rewards}), {"actor_gen/answer_tokens": 1.0}, batch.n_tokens)
    return generate


def source(positions):
    return Batch((1,) * len(positions), {"prompts": torch.ones(len(positions), dtype=torch.long)}, {}, 1,
                 tuple(positions))


MFC_DS = MFC("actor_gen", "generate", "actor", ("prompts",), ("seqs", "prompt_mask", "logprobs", "rewards"), 4, 2, 1, 1,
             options=MFCOptions(group_size=4, dynamic_sampling_rounds=3))


def test_dapo_dynamic_sampling_refills_every_dropped_group_and_keeps_the_batch_full():
    # Even prompt ids (and every seed but the first round's) give groups whose rewards differ; odd ones at seed 100
    # all score 0: prompts 1 and 3 drop out and are replaced in round 1.
    def reward_of(i, seed, j):
        return float(j % 2) if i % 2 == 0 or seed != 100 else 0.0
    calls = []
    prompts = source([0, 1, 2, 3])
    out = dynamic_sampling.fill_batch(fake_generate(reward_of, calls), MFC_DS, prompts, source, 1000, None, 100,
                                      5, 1, lambda flag: flag)
    assert out.batch.n_samples == 4 and out.batch.n_seqs == 16
    assert all(dynamic_sampling.informative(out.batch["rewards"], 4))
    want = [dynamic_sampling.replacement_position(1, 5, 1, i, 1000) for i in (1, 3)]
    assert calls == [([0, 1, 2, 3], 100), (want, 101)]
    assert out.batch.ids == (0, want[0], 2, want[1])
    assert out.stats["actor_gen/dynamic_sampling_rounds"] == 1.0
    assert out.stats["actor_gen/dynamic_sampling_dropped"] == 0.5
    assert out.stats["actor_gen/dynamic_sampling_unfilled"] == 0.0
    assert out.stats["actor_gen/dynamic_sampling_groups"] == 1.5


def test_dapo_dynamic_sampling_stops_after_its_rounds_and_follows_the_other_ranks():
    calls = []
    never = fake_generate(lambda i, seed, j: 1.0, calls)  # every group all-equal
    out = dynamic_sampling.fill_batch(never, MFC_DS, source([7, 8, 9, 10]), source, 1000, None, 100, 0, 1,
                                      lambda flag: flag)
    assert len(calls) == 4 and out.batch.n_samples == 4 and out.batch.ids == (7, 8, 9, 10)  # the first groups kept
    assert (out.stats["actor_gen/dynamic_sampling_rounds"], out.stats["actor_gen/dynamic_sampling_unfilled"]) == (3, 1)
    # A rank whose slots are all full still goes round while another rank needs to (one prompt, discarded).
    calls.clear()
    always = fake_generate(lambda i, seed, j: float(j), calls)
    out = dynamic_sampling.fill_batch(always, MFC_DS, source([7, 8, 9, 10]), source, 1000, None, 100, 0, 1,
                                      lambda flag: True)
    assert [len(ids) for ids, _ in calls] == [4, 1, 1, 1] and out.batch.ids == (7, 8, 9, 10)
    assert out.stats["actor_gen/dynamic_sampling_rounds"] == 3.0 and out.stats["actor_gen/dynamic_sampling_groups"] == 1
