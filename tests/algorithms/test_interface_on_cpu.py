"""The algorithm interface the runtime calls, on hand-made packed batches."""

from pathlib import Path

import pytest
import torch

from restage.algorithms import base, packed_ops
from restage.algorithms.interface import build_graph, check_algorithm, get_algorithm
from restage.config.load import config_from_dict, load_config
from restage.data.batch import pack_sequences
from restage.data.tasks import VOCAB
from restage.data.tokenizer import load_tokenizer
from restage.errors import ConfigError
from restage.graph import MFCOptions, RefEMA

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = ("sft", "rm", "dpo", "ppo", "grpo", "remax", "raft")
MODELS = {"sft": ["actor"], "rm": ["reward"], "dpo": ["actor", "ref"], "ppo": ["actor", "critic", "ref"],
          "grpo": ["actor", "ref"], "remax": ["actor", "ref"], "raft": ["actor"]}


def cfg(algorithm, algo=None, reward_fn="sort", **extra):
    return config_from_dict({"experiment": "x", "algorithm": algorithm, "algo": algo or {}, "reward_fn": reward_fn,
                             "models": {m: {"path": "p", "trainable": m in ("actor", "critic", "reward")}
                                        for m in MODELS[algorithm]}, **extra})


def words(text):
    return [VOCAB.index(w) for w in text.split()]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / "data" / "synthetic" / "tokenizer")


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_follows_the_protocol_and_refuses_unknown_keys(name):
    module = get_algorithm(name)
    check_algorithm(module)
    c = cfg(name)
    state = module.init_state(c)
    for mfc in build_graph(c):
        if mfc.kind != "generate":
            assert set(module.forward_outputs(mfc.name, c)) <= set(base.FORWARD_OUTPUTS)
    with pytest.raises(ConfigError, match=r"^algo.bogus: unknown key"):
        module.validate(cfg(name, {"bogus": 1}))
    assert isinstance(state.state_dict(), dict)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_job_configs_load_and_validate(name):
    path = ROOT / "jobs" / f"{name}_tiny.yaml"
    c = load_config(path)
    assert c.algorithm == name
    get_algorithm(name).validate(c)
    graph = build_graph(c)
    assert (ROOT / c.dataset.path).is_file() and (ROOT / c.dataset.tokenizer / "tokenizer.json").is_file()
    assert all(m.prompt_tokens >= 9 for m in graph)  # "[BOS] sort d d d d d d :" fits


def test_validation_names_the_bad_value():
    with pytest.raises(ConfigError, match="algo.kl_estimator: 'k9' must be one of k1, k2, k3"):
        get_algorithm("ppo").validate(cfg("ppo", {"kl_estimator": "k9"}))
    with pytest.raises(ConfigError, match="algo.loss_type: 'xpo' must be one of dpo, ipo"):
        get_algorithm("dpo").validate(cfg("dpo", {"loss_type": "xpo"}))
    with pytest.raises(ConfigError, match="algo.gamma: 1.5 must be in"):
        get_algorithm("ppo").validate(cfg("ppo", {"gamma": 1.5}))
    with pytest.raises(ConfigError, match="needs a reward: set reward_fn"):
        get_algorithm("grpo").validate(cfg("grpo", reward_fn=""))
    with pytest.raises(ConfigError, match="reward_fn: cannot import module 'no_such_mod'"):
        get_algorithm("grpo").validate(cfg("grpo", reward_fn="no_such_mod:f"))
    for name in ("ppo", "grpo", "remax"):
        with pytest.raises(ConfigError, match=r"^algo.ref_ema_eta: 1.5 must be in \[0, 1\]"):
            get_algorithm(name).validate(cfg(name, {"ref_ema_eta": 1.5}))
        train = next(m for m in build_graph(cfg(name, {"ref_ema_eta": 0.1})) if m.kind == "train_step")
        assert train.options == MFCOptions(ref_ema=RefEMA(0.1, "ref"))  # the runtime's ema op reads these


def rl_batch(group_size=1):
    # Two prompts' worth of sequences: prompt then answer; answers end with EOS (id 2).
    seqs = [[1] + words("sort 2 1 :") + words("1 2") + [2], [1] + words("sort 2 1 :") + words("2 1") + [2],
            [1] + words("sort 3 :") + words("3") + [2], [1] + words("sort 3 :") + words("4 4") + [2]]
    return pack_sequences(seqs, group_size=group_size, prompt_lens=[5, 5, 4, 4])


def test_after_generate_attaches_function_rewards_and_checks_groups(tokenizer):
    c = cfg("grpo", {"group_size": 2})
    state = get_algorithm("grpo").init_state(c, tokenizer)
    batch = get_algorithm("grpo").after_generate("actor_gen", rl_batch(2), c, state)
    near = 0.5 * 8 / 9  # credit of a digit one away from the right one
    assert batch["rewards"].tolist() == pytest.approx([1.0, near, 1.0, near / 2])
    with pytest.raises(ValueError, match="groups of 1, the MFC asks for 2"):
        get_algorithm("grpo").after_generate("actor_gen", rl_batch(1), c, state)
    remax_cfg = cfg("remax")
    remax = get_algorithm("remax")
    greedy = rl_batch().renamed({"seqs": "greedy_seqs", "prompt_mask": "greedy_prompt_mask"})
    out = remax.after_generate("actor_greedy_gen", greedy, remax_cfg, remax.init_state(remax_cfg, tokenizer))
    assert out["baseline_rewards"].tolist() == pytest.approx([1.0, near, 1.0, near / 2])


def test_default_inference_maps_forward_outputs_to_keys():
    c = cfg("ppo", reward_fn="", models={m: {"path": "p"} for m in ("actor", "critic", "ref", "reward")})
    ppo = get_algorithm("ppo")
    state = ppo.init_state(c)
    batch = rl_batch()
    values = torch.arange(batch.n_tokens, dtype=torch.float32)
    assert ppo.forward_outputs("reward_inf", c) == ("values",) and ppo.forward_outputs("ref_inf", c) == ("logprobs",)
    assert ppo.inference("reward_inf", batch, {"values": values}, c, state)["rewards"].tolist() == [7.0, 15.0, 21.0, 28.0]
    assert torch.equal(ppo.inference("ref_inf", batch, {"logprobs": values}, c, state)["ref_logprobs"], values)
    assert torch.equal(ppo.inference("critic_inf", batch, {"values": values}, c, state)["values"], values)


def ppo_inputs(batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    answer = ~batch["prompt_mask"]
    logprobs = -torch.rand(batch.n_tokens, generator=g) * answer
    ref = -torch.rand(batch.n_tokens, generator=g) * answer
    values = torch.randn(batch.n_tokens, generator=g)
    return batch.with_keys(tokens={"logprobs": logprobs, "ref_logprobs": ref, "values": values},
                           seqs={"rewards": torch.tensor([1.0, 0.0, 0.5, -0.5])})


def test_ppo_prepare_train_against_a_hand_computation():
    c = cfg("ppo", {"kl_coef": 0.1, "gamma": 0.9, "lam": 0.8, "value_norm": False, "adv_norm": False,
                    "reward_scale": 2.0, "reward_clip": 1.5})
    ppo = get_algorithm("ppo")
    state = ppo.init_state(c)
    batch = ppo_inputs(rl_batch())
    out, stats = ppo.prepare_train(batch, c, state, step=0)
    lp, ref, v, mask = batch["logprobs"].tolist(), batch["ref_logprobs"].tolist(), batch["values"].tolist(), \
        (~batch["prompt_mask"]).tolist()
    shaped = [min(max(2.0 * r, -1.5), 1.5) for r in batch["rewards"].tolist()]
    start, want_adv, want_ret, want_kl = 0, [0.0] * batch.n_tokens, [0.0] * batch.n_tokens, []
    for s, n in enumerate(batch.seqlens):
        actions = [t for t in range(start, start + n) if mask[t]]
        want_kl.append(sum(lp[t] - ref[t] for t in actions))
        running, next_value = 0.0, 0.0
        for t in reversed(actions):
            r = -0.1 * (lp[t] - ref[t]) + (shaped[s] if t == actions[-1] else 0.0)
            value = v[t - 1]  # the critic's output one token before the action
            running = r + 0.9 * next_value - value + 0.9 * 0.8 * running
            want_adv[t], want_ret[t], next_value = running, running + value, value
        start += n
    assert out["advantages"].tolist() == pytest.approx(want_adv, abs=1e-5)
    assert out["returns"].tolist() == pytest.approx(want_ret, abs=1e-5)
    assert stats["kl"] == pytest.approx(sum(want_kl) / 4, abs=1e-6) and stats["kl_coef"] == 0.1


def test_ppo_value_normaliser_kl_controller_and_step_idempotence():
    c = cfg("ppo", {"adaptive_kl": True, "kl_coef": 0.2, "kl_target": 0.1, "kl_horizon": 40})
    ppo = get_algorithm("ppo")
    state = ppo.init_state(c)
    batch = ppo_inputs(rl_batch())
    out, stats = ppo.prepare_train(batch, c, state, step=0)
    mask = ~batch["prompt_mask"]
    answer_adv = out["advantages"][mask]
    assert float(answer_adv.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(answer_adv.var(unbiased=False)) == pytest.approx(1.0, abs=1e-4)
    # the normaliser saw exactly the raw returns (first update: values are used as they come)
    norm = state["value_norm"]
    raw_returns = out["returns"][mask] * norm.std + norm.mean
    assert norm.count == int(mask.sum())
    assert norm.mean == pytest.approx(float(raw_returns.mean()), abs=1e-5)
    error = max(min(stats["kl"] / 0.1 - 1, 0.2), -0.2)
    assert state["kl_ctl"].value == pytest.approx(0.2 * (1 + error * 4 / 40))
    after_first = state.state_dict()
    ppo.prepare_train(batch, c, state, step=0)  # a second train mesh preparing the same step
    assert state.state_dict() == after_first
    ppo.prepare_train(batch, c, state, step=1)
    assert state["value_norm"].count == 2 * int(mask.sum())
    restored = ppo.init_state(c)
    restored.load_state_dict(state.state_dict())
    assert restored.state_dict() == state.state_dict()


def test_ppo_losses_use_the_right_alignment_and_early_stop():
    c = cfg("ppo", {"early_stop_ratio": 1.5, "value_clip_eps": 0.0})
    ppo = get_algorithm("ppo")
    state = ppo.init_state(c)
    batch, _ = ppo.prepare_train(ppo_inputs(rl_batch()), c, state, step=0)
    mask = ~batch["prompt_mask"]
    loss, stats = ppo.loss("actor_train", batch, {"logprobs": batch["logprobs"].clone()}, c, state)
    assert float(loss) == pytest.approx(-float(batch["advantages"][mask].mean()), abs=1e-6)
    assert stats["early_stop"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)
    loss, stats = ppo.loss("actor_train", batch, {"logprobs": batch["logprobs"] + mask * 1.0}, c, state)
    assert stats["early_stop"] == 1.0 and float(loss) == 0.0
    # critic: predicting the returns one token early gives zero loss
    values = torch.roll(batch["returns"], -1)
    loss, _ = ppo.loss("critic_train", batch, {"values": values}, c, state)
    assert float(loss) == pytest.approx(0.0, abs=1e-10)


def test_grpo_prepare_and_loss():
    c = cfg("grpo", {"group_size": 2, "kl_coef": 0.5})
    grpo = get_algorithm("grpo")
    state = grpo.init_state(c)
    batch = ppo_inputs(rl_batch(2)).with_keys(seqs={"rewards": torch.tensor([3.0, 1.0, 0.0, 0.0])})
    out, _ = grpo.prepare_train(batch, c, state)
    mask = ~batch["prompt_mask"]
    per_seq = [float(out["advantages"][batch.cu_seqlens[i + 1] - 1]) for i in range(4)]
    # group (3, 1): mean 2, unbiased std sqrt(2); group (0, 0): 0
    assert per_seq == pytest.approx([2 ** -0.5, -(2 ** -0.5), 0.0, 0.0], abs=1e-5)
    assert float(out["advantages"][~mask].abs().sum()) == 0.0 and out.group_size == 1
    loss, stats = grpo.loss("actor_train", out, {"logprobs": batch["logprobs"]}, c, state)
    d = batch["ref_logprobs"] - batch["logprobs"]
    k3 = torch.exp(d) - d - 1
    seq_k3 = packed_ops.seq_sum(k3 * mask, batch.cu_seqlens) / packed_ops.seq_sum(mask.float(), batch.cu_seqlens)
    pg = [-a for a in per_seq]  # ratio 1: -A on every token; seq_mean of constants
    assert float(loss) == pytest.approx(sum(pg) / 4 + 0.5 * float(seq_k3.mean()), abs=1e-5)
    assert stats["kl"] == pytest.approx(float(seq_k3.mean()), abs=1e-6)


def test_remax_advantage_is_reward_to_go_minus_greedy_baseline():
    c = cfg("remax", {"kl_coef": 0.0})
    remax = get_algorithm("remax")
    batch = ppo_inputs(rl_batch()).with_keys(seqs={"baseline_rewards": torch.tensor([0.5, 0.5, 1.0, 0.0])})
    out, stats = remax.prepare_train(batch, c, remax.init_state(c))
    mask = ~batch["prompt_mask"]
    want = torch.tensor([0.5, -0.5, -0.5, -0.5]).repeat_interleave(torch.tensor(batch.seqlens)) * mask
    assert torch.allclose(out["advantages"], want)
    assert stats["baseline_reward"] == pytest.approx(0.5)


def test_raft_keeps_the_best_of_each_group_and_trains_on_it():
    c = cfg("raft", {"group_size": 2})
    raft = get_algorithm("raft")
    state = raft.init_state(c)
    batch = rl_batch(2).with_keys(seqs={"rewards": torch.tensor([0.2, 0.9, 0.7, 0.7])})
    out, stats = raft.prepare_train(batch, c, state)
    assert out.n_seqs == 2 and out["rewards"].tolist() == pytest.approx([0.9, 0.7])
    whole = rl_batch()
    cu = whole.cu_seqlens.tolist()
    assert out["seqs"].tolist() == whole["seqs"][cu[1]:cu[3]].tolist()  # sequence 1 (0.9) and 2 (first of a tie)
    assert stats["best_reward"] == pytest.approx(0.8)
    lp = -torch.ones(out.n_tokens)
    loss, _ = raft.loss("actor_train", out, {"logprobs": lp}, c, state)
    assert float(loss) == pytest.approx(1.0)


def test_rm_and_dpo_losses_on_pairs():
    pairs = pack_sequences([[1, 5, 6], [1, 5, 7, 8], [1, 9], [1, 4]], group_size=2, prompt_lens=[2, 2, 1, 1])
    rm = get_algorithm("rm")
    c = cfg("rm")
    values = torch.zeros(pairs.n_tokens)
    values[pairs.cu_seqlens[1:].long() - 1] = torch.tensor([2.0, 1.0, -1.0, 0.0])
    _, stats = rm.loss("reward_train", pairs, {"values": values}, c, rm.init_state(c))
    assert stats["accuracy"] == 0.5 and stats["chosen_score"] == pytest.approx(0.5)
    dpo = get_algorithm("dpo")
    c = cfg("dpo", {"beta": 1.0})
    ref = torch.zeros(pairs.n_tokens)
    policy = -(~pairs["prompt_mask"]).float() * torch.tensor([0.0, 0.0, 1.0, 0, 0, 2.0, 2.0, 0.0, 3.0, 0.0, 1.0])
    loss, stats = dpo.loss("actor_train", pairs.with_keys(tokens={"ref_logprobs": ref}), {"logprobs": policy}, c,
                           dpo.init_state(c))
    # pair 0: h = -1 - (-4) = 3; pair 1: h = -3 - (-1) = -2
    assert stats["accuracy"] == 0.5 and stats["margin"] == pytest.approx(0.5)
    want = (torch.nn.functional.softplus(torch.tensor(-3.0)) + torch.nn.functional.softplus(torch.tensor(2.0))) / 2
    assert float(loss) == pytest.approx(float(want), abs=1e-6)


def thread_all_reduce(n_ranks):
    """A SUM all-reduce between ``n_ranks`` threads, standing in for torch.distributed in the DP group."""
    import threading

    barrier, slots = threading.Barrier(n_ranks), {}

    def make(rank):
        def reduce(t):
            slots[rank] = t.clone()
            barrier.wait()
            total = sum(slots[r] for r in range(n_ranks))
            barrier.wait()
            return total
        return reduce
    return [make(r) for r in range(n_ranks)]


def test_ppo_prepare_train_on_shards_with_reduce_equals_the_whole_batch():
    import threading

    from restage.data.batch import concat

    c = cfg("ppo", {"adaptive_kl": True, "kl_target": 0.5})
    ppo = get_algorithm("ppo")
    whole = ppo_inputs(rl_batch())
    expected, expected_stats = ppo.prepare_train(whole, c, (whole_state := ppo.init_state(c)), step=0)
    shards, states, results = whole.split(2), [ppo.init_state(c) for _ in range(2)], [None, None]
    reducers = thread_all_reduce(2)

    def rank(r):
        results[r] = ppo.prepare_train(shards[r], c, states[r], step=0, reduce=reducers[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    joined = concat([results[0][0], results[1][0]])
    for key in ("advantages", "returns", "old_values"):
        assert torch.allclose(joined[key], expected[key], atol=1e-5), key
    for r in range(2):
        assert results[r][1] == pytest.approx(expected_stats)
        for name, part in whole_state.state_dict().items():
            assert states[r].state_dict()[name] == pytest.approx(part), name
