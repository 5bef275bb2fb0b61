"""Async mode's algorithm side: the decoupled PPO objective, its importance-weight cap, token ages, the graphs."""

import math

import pytest
import torch

from restage.algorithms import losses, offpolicy, registry
from restage.algorithms.base import CallContext
from restage.algorithms.interface import build_graph, get_algorithm
from restage.config.load import config_from_dict
from restage.data.batch import pack_sequences
from restage.errors import ConfigError, StalenessError

MODELS = {"sft": ["actor"], "rm": ["reward"], "dpo": ["actor", "ref"], "ppo": ["actor", "critic", "ref"],
          "grpo": ["actor", "ref"], "remax": ["actor", "ref"], "raft": ["actor"]}


def cfg(name, algo=None, execution="sync", staleness=1):
    return config_from_dict({"experiment": "x", "algorithm": name, "algo": algo or {}, "reward_fn": "sort",
                             "plan": {"execution": execution, "staleness": staleness},
                             "models": {m: {"path": "p", "trainable": m != "ref"} for m in MODELS[name]}})


def rl_batch(group=1):
    """Four answers (prompts of 5, 5, 4, 4 tokens), behaviour and reference log-probs, values, rewards."""
    seqs = [[1, 14, 6, 5, 15, 5, 6, 2], [1, 14, 6, 5, 15, 6, 5, 2], [1, 14, 7, 15, 7, 2], [1, 14, 7, 15, 8, 8, 2]]
    b = pack_sequences(seqs, group_size=group, prompt_lens=[5, 5, 4, 4])
    g = torch.Generator().manual_seed(3)
    answer = ~b["prompt_mask"]
    return b.with_keys(tokens={"logprobs": -torch.rand(b.n_tokens, generator=g) * answer,
                               "ref_logprobs": -torch.rand(b.n_tokens, generator=g) * answer,
                               "values": torch.randn(b.n_tokens, generator=g)},
                       seqs={"rewards": torch.tensor([1.0, 0.0, 0.5, -0.5]),
                             "baseline_rewards": torch.tensor([0.5, 0.5, 0.0, 0.0])})


# --- the objective against a hand computation ---------------------------------------------------------------

def hand_example():
    """One prompt token, then five answer tokens, each set up for one case (eps 0.2, cap 2):

    token  r = pi/prox  w = prox/behav  A    case
    1      1.1          1.0             +1   inside the clip range: -A r w = -1.1, d/dlogp = -A r w = -1.1
    2      1.5          1.5             +2   clipped above: -A (1 + eps) w = -3.6, no gradient
    3      0.5          0.5             -1   clipped below: -A (1 - eps) w = 0.4, no gradient
    4      1.0          3.0             +1   w > cap: dropped (0, no gradient), still counted in the mean
    5      0.9          1.25            -2   inside: -A r w = 2.25, d/dlogp = 2.25
    """
    prox = torch.tensor([0.0, -1.0, -0.5, -2.0, -1.0, -0.3])
    ratio = torch.tensor([1.0, 1.1, 1.5, 0.5, 1.0, 0.9])
    weight = torch.tensor([1.0, 1.0, 1.5, 0.5, 3.0, 1.25])
    logprobs = (prox + ratio.log()).requires_grad_(True)
    behav = (prox - weight.log()).requires_grad_(True)
    advantages = torch.tensor([0.0, 1.0, 2.0, -1.0, 1.0, -2.0])
    mask = torch.tensor([False, True, True, True, True, True])
    return logprobs, prox, behav, advantages, mask, torch.tensor([0, 6], dtype=torch.int32)


def test_decoupled_loss_value_gradient_and_statistics_by_hand():
    logprobs, prox, behav, advantages, mask, cu = hand_example()
    loss, stats = losses.decoupled_policy_loss(logprobs, prox, behav, advantages, mask, cu, 0.2, 2.0)
    assert float(loss.detach()) == pytest.approx((-1.1 - 3.6 + 0.4 + 0.0 + 2.25) / 5, abs=1e-6)  # -0.41
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, -1.1 / 5, 0.0, 0.0, 0.0, 2.25 / 5], abs=1e-6)
    assert behav.grad is None  # the importance weight is a constant
    assert stats["clip_fraction"] == pytest.approx(2 / 5)  # tokens 2 and 3
    assert stats["behav_imp_weight_mean"] == pytest.approx((1.0 + 1.5 + 0.5 + 3.0 + 1.25) / 5, abs=1e-6)
    assert stats["behav_imp_weight_max"] == pytest.approx(3.0, abs=1e-6)
    assert stats["behav_imp_weight_dropped"] == pytest.approx(1 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.5 + 1.0 + 0.9) / 5, abs=1e-6)


def test_seq_mean_aggregation_weights_each_sequence_alike():
    logprobs, prox, behav, advantages, mask, _ = hand_example()
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)  # tokens 1-2 | tokens 3-5
    loss, _ = losses.decoupled_policy_loss(logprobs, prox, behav, advantages, mask, cu, 0.2, 2.0, "seq_mean")
    assert float(loss.detach()) == pytest.approx(((-1.1 - 3.6) / 2 + (0.4 + 0.0 + 2.25) / 3) / 2, abs=1e-6)


@pytest.mark.parametrize("agg", registry.names(registry.AGGREGATIONS))
def test_with_prox_equal_to_behaviour_it_is_the_standard_clipped_loss_to_the_bit(agg):
    g = torch.Generator().manual_seed(0)
    n = 40
    behav = -torch.rand(n, generator=g) * 3
    advantages = torch.randn(n, generator=g)
    mask = torch.rand(n, generator=g) > 0.2
    cu = torch.tensor([0, 9, 25, 40], dtype=torch.int32)
    start = behav + 0.3 * torch.randn(n, generator=g)  # ratios well outside 1 +- eps: both branches taken
    new_a, new_b = start.clone().requires_grad_(True), start.clone().requires_grad_(True)
    standard, standard_stats = losses.policy_loss(new_a, behav, advantages, mask, cu, 0.2, agg, norm_tokens=16)
    decoupled, stats = losses.decoupled_policy_loss(new_b, behav.clone(), behav, advantages, mask, cu, 0.2, 5.0, agg,
                                                    norm_tokens=16)
    standard.backward()
    decoupled.backward()
    assert 0 < standard_stats["clip_fraction"] < 1
    assert torch.equal(standard, decoupled) and torch.equal(new_a.grad, new_b.grad)
    assert {k: stats[k] for k in standard_stats} == standard_stats
    assert (stats["behav_imp_weight_mean"], stats["behav_imp_weight_dropped"]) == (1.0, 0.0)


def test_the_cap_drops_tokens_above_it_keeps_those_at_it_and_zero_turns_it_off():
    prox = torch.tensor([0.0, 0.0, 0.0, 0.0])
    behav = -torch.tensor([1.0, 2.0, 2.0001, 5.0]).log()  # weights 1, 2, just above 2, 5
    mask = torch.tensor([True, True, True, False])
    weights, stats = losses.behaviour_weights(prox, behav, mask, cap=2.0)
    assert weights.tolist() == pytest.approx([1.0, 2.0, 0.0, 0.0])  # at the cap kept; above dropped; off mask 0
    assert stats["behav_imp_weight_dropped"] == pytest.approx(1 / 3)
    assert stats["behav_imp_weight_max"] == pytest.approx(2.0001, abs=1e-5)  # before the cap, masked tokens only
    weights, stats = losses.behaviour_weights(prox, behav, mask, cap=0.0)
    assert weights.tolist() == pytest.approx([1.0, 2.0, 2.0001, 0.0], abs=1e-5)
    assert stats["behav_imp_weight_dropped"] == 0.0
    # a dropped token still counts in the token mean: one kept token of -A r w = -1 over two tokens
    logprobs = torch.zeros(2, requires_grad=True)
    loss, _ = losses.decoupled_policy_loss(logprobs, torch.zeros(2), -torch.tensor([1.0, 9.0]).log(),
                                           torch.ones(2), torch.ones(2, dtype=torch.bool),
                                           torch.tensor([0, 2], dtype=torch.int32), 0.2, 5.0)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(-0.5) and logprobs.grad.tolist() == pytest.approx([-0.5, 0.0])
    for name in ("ppo", "grpo", "remax"):
        assert get_algorithm(name).validate(cfg(name, {"behav_imp_weight_cap": 0.0})).behav_imp_weight_cap == 0.0
        with pytest.raises(ConfigError, match=r"^algo.behav_imp_weight_cap: 0.5 must be > 1 \(or 0"):
            get_algorithm(name).validate(cfg(name, {"behav_imp_weight_cap": 0.5}))


# --- token ages -----------------------------------------------------------------------------------------------

def test_version_gap_histogram_on_a_known_example():
    # prompt tokens carry -1 and are not counted; answers of versions 5, 4, 4, 3, 5, 3 trained at version 5
    versions = torch.tensor([-1, -1, 5, 4, 4, -1, 3, 5, 3])
    mask = versions >= 0
    stats = offpolicy.version_gap_stats(versions, mask, offpolicy.TrainVersion(policy_version=5, staleness=2))
    assert stats == {"version_gap_0": 2 / 6, "version_gap_1": 2 / 6, "version_gap_2": 2 / 6,
                     "version_gap_mean": 1.0, "version_gap_max": 2.0}
    stats = offpolicy.version_gap_stats(versions, mask, offpolicy.TrainVersion(policy_version=6, staleness=3))
    assert stats == {"version_gap_0": 0.0, "version_gap_1": 2 / 6, "version_gap_2": 2 / 6, "version_gap_3": 2 / 6,
                     "version_gap_mean": 2.0, "version_gap_max": 3.0}


def test_answer_versions_mark_prompts_minus_one():
    versions = offpolicy.answer_versions(torch.tensor([True, True, False, False, True, False]), 4)
    assert versions.dtype == torch.int64 and versions.tolist() == [-1, -1, 4, 4, -1, 4]


def test_a_token_older_than_the_staleness_bound_is_refused():
    versions = torch.tensor([-1, 5, 4, 2, 2])
    mask = versions >= 0
    with pytest.raises(StalenessError, match=r"^actor_train at policy version 5 got 2 answer tokens from version 2 "
                                             r"\(3 versions old\), past plan.staleness=2; raise plan.staleness to 3"):
        offpolicy.version_gap_stats(versions, mask, offpolicy.TrainVersion(5, 2))
    assert offpolicy.version_gap_stats(versions, mask, offpolicy.TrainVersion(5, 3))["version_gap_3"] == 0.5
    with pytest.raises(ValueError, match="version 6, which does not exist yet"):
        offpolicy.version_gap_stats(torch.tensor([6, 5]), torch.tensor([True, True]), offpolicy.TrainVersion(5, 2))
    # prompt tokens (-1) are never counted, however old that looks
    assert offpolicy.version_gap_stats(torch.tensor([-1, 5]), torch.tensor([False, True]),
                                       offpolicy.TrainVersion(5, 1))["version_gap_0"] == 1.0


# --- the graphs ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ppo", "grpo", "remax"])
def test_policy_gradient_graphs_gain_actor_prox_only_in_async_mode(name):
    sync = build_graph(cfg(name))
    assert "actor_prox" not in [m.name for m in sync]
    assert not {"versions", "prox_logprobs"} & {k for m in sync for k in m.inputs + m.outputs}
    graph = build_graph(cfg(name, execution="async", staleness=2))
    names = [m.name for m in graph]
    assert names == [n for m in sync for n in (["actor_prox"] if m.name == "actor_train" else []) + [m.name]]
    prox, gen, train = graph["actor_prox"], graph["actor_gen"], graph["actor_train"]
    assert (prox.kind, prox.model, prox.inputs, prox.outputs) == ("inference", "actor", ("seqs", "prompt_mask"),
                                                                  ("prox_logprobs",))
    assert (prox.n_seqs, prox.prompt_tokens, prox.gen_tokens) == (train.n_seqs, train.prompt_tokens, train.gen_tokens)
    assert gen.outputs == sync["actor_gen"].outputs + ("versions",)
    at = sync["actor_train"].inputs.index("logprobs") + 1
    assert train.inputs == sync["actor_train"].inputs[:at] + ("prox_logprobs", "versions") + sync["actor_train"].inputs[at:]
    for mfc in graph:  # everything else as in sync mode
        if mfc.name not in ("actor_prox", "actor_gen", "actor_train"):
            assert mfc == sync[mfc.name]
    algo, c = get_algorithm(name), cfg(name, execution="async")
    assert algo.forward_outputs("actor_prox", c) == ("logprobs",)
    logprobs = torch.arange(6, dtype=torch.float32)
    out = algo.inference("actor_prox", rl_batch(), {"logprobs": logprobs}, c, algo.init_state(c))
    assert list(out) == ["prox_logprobs"] and torch.equal(out["prox_logprobs"], logprobs)


@pytest.mark.parametrize("name", ["sft", "rm", "dpo", "raft"])
def test_algorithms_without_an_async_mode_refuse_it(name):
    with pytest.raises(ConfigError, match=f"^{name} has no asynchronous mode .*: set plan.execution=sync"):
        build_graph(cfg(name, execution="async"))


def test_config_checks_the_mode_and_the_bound():
    assert (cfg("grpo").plan.execution, cfg("grpo").plan.staleness) == ("sync", 1)
    with pytest.raises(ConfigError, match="^plan.execution: 'overlap' must be one of sync, async, auto"):
        cfg("grpo", execution="overlap")
    with pytest.raises(ConfigError, match="^plan.staleness: 0 must be >= 1"):
        cfg("grpo", execution="async", staleness=0)


# --- through the algorithms --------------------------------------------------------------------------------------

# The sync losses and their gradients on ``rl_batch`` (seed 3, policy log-probs seed 4), computed by main at
# 0e0cfeb, before async mode existed: the sync path must stay the same to the bit.
SYNC_BEFORE = {
    "grpo": ("0x1.c97a140000000p-4", {5: "-0x1.be45120000000p-5", 6: "-0x1.25e21c0000000p-5", 7: "-0x1.68e9580000000p-11",
                                      13: "0x1.16d7060000000p-4", 14: "0x1.a8f1e40000000p-4", 15: "-0x1.802d200000000p-12",
                                      20: "-0x1.4d03020000000p-4", 21: "-0x1.1ff2e40000000p-4", 26: "0x1.1987e00000000p-13",
                                      27: "0x1.233a940000000p-4", 28: "0x1.3d843a0000000p-4"}),
    "ppo": ("-0x1.ffa3a20000000p-6", {5: "-0x1.e64d8c0000000p-5", 13: "0x1.34f9f60000000p-6", 14: "0x1.96ca2e0000000p-5",
                                      20: "-0x1.86f3f20000000p-5", 21: "-0x1.26b51e0000000p-4", 27: "0x1.6fba800000000p-4"}),
    "remax": ("0x1.15f0ac0000000p-3", {5: "-0x1.74ee820000000p-5", 6: "-0x1.73a2740000000p-6", 13: "0x1.be582a0000000p-5",
                                       14: "0x1.501e0c0000000p-4", 20: "-0x1.3d39120000000p-5", 21: "-0x1.1db1840000000p-5",
                                       27: "0x1.da7c9e0000000p-5", 28: "0x1.010ab20000000p-4"}),
}
ALGO = {"grpo": ({"group_size": 2}, 2), "ppo": ({}, 1), "remax": ({}, 1)}


def actor_loss(name, execution, extra=None, policy_version=None):
    algo_keys, group = ALGO[name]
    c = cfg(name, algo_keys, execution, staleness=2)
    algo = get_algorithm(name)
    state = algo.init_state(c)
    prepared, _ = algo.prepare_train(rl_batch(group), c, state, step=0)
    if extra:
        prepared = prepared.with_keys(tokens=extra(prepared))
    g = torch.Generator().manual_seed(4)
    new = (prepared["logprobs"] + 0.3 * torch.randn(prepared.n_tokens, generator=g)).requires_grad_(True)
    loss, stats = algo.loss("actor_train", prepared, {"logprobs": new}, c, state, CallContext(policy_version))
    loss.backward()
    return loss, new.grad, stats


@pytest.mark.parametrize("name", ["grpo", "ppo", "remax"])
def test_sync_losses_are_those_of_before_and_async_with_fresh_tokens_equals_them(name):
    loss, grad, stats = actor_loss(name, "sync")
    want_loss, want_grad = SYNC_BEFORE[name]
    assert loss.item().hex() == want_loss
    assert {i: g.hex() for i, g in enumerate(grad.tolist()) if g != 0} == want_grad
    assert not any(k.startswith(("version_gap", "behav_imp")) for k in stats)

    def fresh(batch):  # the proximal policy is the behaviour policy, every token of the version being trained
        return {"prox_logprobs": batch["logprobs"].clone(), "versions": torch.where(batch["prompt_mask"], -1, 7)}

    async_loss, async_grad, async_stats = actor_loss(name, "async", fresh, policy_version=7)
    assert torch.equal(async_loss, loss) and torch.equal(async_grad, grad)
    assert {k: async_stats[k] for k in stats} == stats
    assert async_stats["version_gap_0"] == 1.0 and async_stats["behav_imp_weight_mean"] == 1.0


def test_async_grpo_weights_stale_tokens_and_refuses_too_old_ones():
    def stale(batch):  # the proximal policy moved by log 1.5 on every answer token since the behaviour policy
        answer = ~batch["prompt_mask"]
        versions = torch.where(batch["prompt_mask"], -1, 9 - torch.arange(batch.n_tokens) % 3)  # gaps 0, 1, 2
        return {"prox_logprobs": batch["logprobs"] + math.log(1.5) * answer, "versions": versions}

    loss, grad, stats = actor_loss("grpo", "async", stale, policy_version=9)
    assert stats["behav_imp_weight_mean"] == pytest.approx(1.5, abs=1e-5)
    assert stats["version_gap_max"] == 2.0 and sum(stats[f"version_gap_{g}"] for g in range(3)) == pytest.approx(1.0)
    _, sync_grad, _ = actor_loss("grpo", "sync")
    # same tokens, ratios now against prox: every gradient differs from sync, none crosses a prompt token
    assert float(grad[sync_grad == 0].abs().sum()) == 0.0 and not torch.equal(grad, sync_grad)
    with pytest.raises(StalenessError, match="past plan.staleness=2"):
        actor_loss("grpo", "async", stale, policy_version=10)
    with pytest.raises(ValueError, match="the runtime set no policy_version"):
        actor_loss("grpo", "async", stale)
