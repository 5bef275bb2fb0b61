"""PPO, GRPO and ReMax with ``kl_coef`` 0: no ``ref_inf`` MFC, no ``models.ref``, and the same numbers as with one.

"The same numbers" is checked against the KL term computed from a real reference forward and multiplied
by 0 (what the algorithms did before they dropped the reference), on a tiny model's real log-probs.
"""

import pytest
import torch
from tiny_loop import logprobs, tiny_model

from restage.algorithms import _policy, losses
from restage.algorithms.interface import build_graph, get_algorithm, unused_models
from restage.config.load import config_from_dict
from restage.data.batch import pack_sequences
from restage.data.tasks import VOCAB
from restage.errors import ConfigError
from restage.graph import RefEMA

KL_ALGORITHMS = ("ppo", "grpo", "remax")
TRAINED = {"ppo": ("actor", "critic"), "grpo": ("actor",), "remax": ("actor",)}


def cfg(algorithm, algo=None, ref=True):
    models = {m: {"path": "p", "trainable": True} for m in TRAINED[algorithm]}
    if ref:
        models["ref"] = {"path": "p"}
    return config_from_dict({"experiment": "x", "algorithm": algorithm, "algo": algo or {}, "reward_fn": "sort",
                             "models": models})


def words(text):
    return [VOCAB.index(w) for w in text.split()]


@pytest.mark.parametrize("name", KL_ALGORITHMS)
def test_kl_coef_0_drops_the_reference_from_the_graph_and_the_config(name):
    graph = build_graph(cfg(name, {"kl_coef": 0.0}, ref=False))
    assert "ref_inf" not in [m.name for m in graph] and "ref" not in graph.models()
    assert all("ref_logprobs" not in m.inputs for m in graph) and "ref_logprobs" not in graph.source_keys()
    state = get_algorithm(name).init_state(cfg(name, {"kl_coef": 0.0}, ref=False))
    assert not _policy.uses_ref(state.params)
    # The default and any positive coefficient keep the reference pass, and without models.ref say what to add.
    for algo in ({}, {"kl_coef": 0.01}):
        with_ref = build_graph(cfg(name, algo))
        assert with_ref["ref_inf"].model == "ref" and "ref_logprobs" in with_ref["actor_train"].inputs
        with pytest.raises(ConfigError, match=rf"^{name} needs a reference model \(algo.kl_coef is 0.0?[1-9]+\): add "
                                              r"models.ref .* or set algo.kl_coef=0 to train without one$"):
            build_graph(cfg(name, algo, ref=False))
    # A reference EMA needs the reference model even with no KL term.
    ema = build_graph(cfg(name, {"kl_coef": 0.0, "ref_ema_eta": 0.1}))
    assert ema["ref_inf"].model == "ref" and ema["actor_train"].options.ref_ema == RefEMA(0.1, "ref")
    with pytest.raises(ConfigError, match=r"\(algo.ref_ema_eta is 0.1\): add models.ref .* set algo.ref_ema_eta=0 "):
        build_graph(cfg(name, {"kl_coef": 0.0, "ref_ema_eta": 0.1}, ref=False))


def test_a_given_reference_at_kl_coef_0_is_reported_unused_and_others_are_not():
    c = cfg("grpo", {"kl_coef": 0})
    assert unused_models(c, build_graph(c)) == {"ref": "algo.kl_coef is 0, so grpo computes no KL to a reference model"}
    c = cfg("grpo", {"kl_coef": 0.04})
    assert unused_models(c, build_graph(c)) == {}
    c = cfg("grpo", {"kl_coef": 0, "ref_ema_eta": 0.5})
    assert unused_models(c, build_graph(c)) == {}
    dpo = config_from_dict({"experiment": "x", "algorithm": "dpo", "dataset": {"kind": "preference"},
                            "models": {"actor": {"path": "p", "trainable": True}, "ref": {"path": "p"}}})
    assert build_graph(dpo)["ref_inf"].model == "ref" and unused_models(dpo, build_graph(dpo)) == {}


@pytest.fixture(scope="module")
def sampled():
    """Four sort answers (two groups of two) with an actor's and a different reference model's log-probs."""
    seqs = [[1] + words("sort 2 1 :") + words("1 2") + [2], [1] + words("sort 2 1 :") + words("2 1 1") + [2],
            [1] + words("sort 3 1 :") + words("1 3") + [2], [1] + words("sort 3 1 :") + words("3") + [2]]
    batch = pack_sequences(seqs, group_size=2, prompt_lens=[5, 5, 5, 5])
    actor, ref = tiny_model(seed=0), tiny_model(seed=1)
    answer = ~batch["prompt_mask"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Old log-probs a little off the actor's, so the ratio is not 1 and clipping has work to do.
        old = (logprobs(actor, batch, "seqs") + 0.3 * torch.randn(batch.n_tokens, generator=g)) * answer
        ref_lp = logprobs(ref, batch, "seqs") * answer
    batch = batch.with_keys(tokens={"logprobs": old.float(), "values": torch.randn(batch.n_tokens, generator=g)},
                            seqs={"rewards": torch.tensor([1.0, 0.25, 0.5, 0.0]),
                                  "baseline_rewards": torch.tensor([0.5, 0.5, 0.25, 0.25])})
    return actor, batch, ref_lp.float()


def _loss_and_grads(actor, loss_fn):
    actor.zero_grad()
    value, stats = loss_fn()
    value.backward()
    return value.detach(), stats, [p.grad.clone() for p in actor.parameters()]


def test_grpo_loss_and_gradient_at_kl_0_equal_the_kl_term_times_0(sampled):
    actor, batch, ref_lp = sampled
    grpo = get_algorithm("grpo")
    c = cfg("grpo", {"group_size": 2, "kl_coef": 0.0, "clip_eps": 0.1}, ref=False)
    state = grpo.init_state(c)
    prepared, prep_stats = grpo.prepare_train(batch, c, state)

    def without_ref():  # the batch holds no ref_logprobs: the reference never ran
        return grpo.loss("actor_train", prepared, {"logprobs": logprobs(actor, prepared, "seqs")}, c, state)

    def kl_times_0():  # the KL term of a real reference forward, weighted by 0
        with_ref = prepared.with_keys(tokens={"ref_logprobs": ref_lp})
        new = logprobs(actor, with_ref, "seqs")
        kl = losses.kl_estimate(new.float(), ref_lp, "k3")
        return _policy.actor_loss(with_ref, {"logprobs": new}, state.params, kl, 0.0)

    loss, stats, grads = _loss_and_grads(actor, without_ref)
    ref_loss, ref_stats, ref_grads = _loss_and_grads(actor, kl_times_0)
    assert "ref_logprobs" not in prepared and float(loss) != 0.0
    assert torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert ref_stats.pop("kl") > 0 and stats == ref_stats and stats["clip_fraction"] > 0
    assert prep_stats == grpo.prepare_train(batch.with_keys(tokens={"ref_logprobs": ref_lp}), c, state)[1]


@pytest.mark.parametrize("name", ("ppo", "remax"))
def test_ppo_and_remax_prepare_train_at_kl_0_equal_the_kl_shaping_times_0(sampled, name):
    """With a reference EMA the reference still runs at kl_coef 0 and its KL is shaped in with weight 0 (the
    computation before the reference was dropped); without one the advantages, returns and stats are the same."""
    actor, batch, ref_lp = sampled
    algorithm = get_algorithm(name)
    algo = {"kl_coef": 0.0} if name == "remax" else {"kl_coef": 0.0, "gamma": 0.9, "lam": 0.8, "adaptive_kl": True}
    c, c_ref = cfg(name, algo, ref=False), cfg(name, {**algo, "ref_ema_eta": 0.5})
    batch = batch.with_keys(group_size=1)
    out, stats = algorithm.prepare_train(batch, c, algorithm.init_state(c))
    out_ref, stats_ref = algorithm.prepare_train(batch.with_keys(tokens={"ref_logprobs": ref_lp}), c_ref,
                                                 algorithm.init_state(c_ref))
    assert stats_ref.pop("kl") > 0 and stats == stats_ref
    for key in ("advantages", "returns", "old_values") if name == "ppo" else ("advantages",):
        assert torch.equal(out[key], out_ref[key]) and out[key].abs().sum() > 0
    state = algorithm.init_state(c)
    loss, _ = algorithm.loss("actor_train", out, {"logprobs": logprobs(actor, out, "seqs")}, c, state)
    loss_ref, _ = algorithm.loss("actor_train", out_ref, {"logprobs": logprobs(actor, out_ref, "seqs")}, c_ref,
                                 algorithm.init_state(c_ref))
    assert torch.equal(loss, loss_ref)
