"""Each GRPO-family variant raises the sort task's reward (issue 31): the tiny loop of test_learning_on_cpu.py.

One shared loop (``variant_rewards``): a tiny LLaMA samples 8 answers to each of 8 prompts a step, the variant's
own interface functions (``after_generate``, ``prepare_train``, ``loss``) make the update. The measure: the mean
reward of the answers sampled each step, the first 5 steps against the last 10, after 50 steps, for seeds 0, 1, 2.
The bar is issue 31's +0.10 on the mean over the seeds (plain GRPO measures +0.103 so: 0.102, 0.119, 0.087), and
+0.05 (the existing GRPO test's bar) on every seed. DAPO's dynamic sampling runs through
``runtime/step/dynamic_sampling.py``'s ``fill_batch`` (the runtime's own refill), and each step's batch is asserted full.
The importance-sampling test gives the generation log-probs a simulated layout mismatch (noise of 0.05) against the
training layout's. RLOO and Dr. GRPO run without a KL term (``kl_coef: 0``, as Dr. GRPO's own scripts do,
sail-sg/understand-r1-zero examples/*.sh ``--beta 0``): their advantages are not divided by the group's std, so
the shared ``kl_coef: 0.01`` weighs about ten times more against them than against GRPO's (measured with it: +0.085
and +0.071).

Every test here is marked ``scale`` (``make test-scale`` or ``pytest --scale``): 25-60 s each on 2 cores, 6 min in
all; the default suite has DAPO's dynamic sampling end to end (tests/e2e/test_dapo_dynamic_sampling.py) and each
variant's arithmetic (test_variants_on_cpu.py).
"""

import copy
from pathlib import Path

import pytest
import torch
from tiny_loop import logprobs, sample, tiny_model

from restage.algorithms.interface import get_algorithm
from restage.algorithms.rewards import function_rewards, register_reward
from restage.config.load import config_from_dict
from restage.data import datasets, sources, tasks
from restage.data.tokenizer import load_tokenizer
from restage.runtime.step import dynamic_sampling
from restage.runtime.step.execute import MFCResult

SHIPPED = Path(__file__).resolve().parents[2] / "data" / "synthetic"
STEPS, GROUP, PROMPTS, SEEDS = 50, 8, 8, (0, 1, 2)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(SHIPPED / "tokenizer")


def sort_pass(prompts, answers):
    """DAPO's kind of reward, right or wrong: 1 where the sort score is at least 0.3 (some groups score all 0)."""
    return [float(s >= 0.3) for s in tasks.reward(prompts, answers)]


register_reward("sort_pass", sort_pass)


def variant_rewards(tokenizer, algo_keys: dict, steps: int = STEPS, seed: int = 0, mismatch: float = 0.0,
                    reward_fn: str = "sort", epochs: int = 1):
    """Per step: the mean sort score of the answers the policy sampled (the first round's, under dynamic sampling;
    the score whatever ``reward_fn`` trains on), and the dynamic-sampling statistics of each step (empty without)."""
    c = config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": reward_fn,
                          "models": {"actor": {"path": "p"}, "ref": {"path": "p"}},
                          "generation": {"max_new_tokens": 7},
                          "algo": {"group_size": GROUP, "kl_coef": 0.01, **algo_keys}})
    grpo = get_algorithm("grpo")
    state = grpo.init_state(c, tokenizer)
    rows = sources.read_jsonl(SHIPPED / "prompts.jsonl", ("prompt",))
    examples = datasets.tokenize(rows, "prompt", tokenizer, 9, 7)
    torch.manual_seed(seed)
    model = tiny_model(seed)
    ref = copy.deepcopy(model).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.Generator().manual_seed(seed + 1)
    scores, ds_stats = [], []
    sampled: list[float] = []

    def generate(prompts, _seed):
        batch = grpo.after_generate("actor_gen", sample(model, prompts, GROUP, 7, generator=generator), c, state)
        score = batch["rewards"] if reward_fn == "sort" else function_rewards(batch, tasks.reward, tokenizer)
        sampled.append(float(score.mean()))
        return MFCResult(batch, {}, batch.n_tokens)

    for step in range(steps):
        prompts = datasets.collate(examples[step * PROMPTS:(step + 1) * PROMPTS], "prompt")
        sampled.clear()
        gen_mfc = state.graph["actor_gen"]
        if gen_mfc.options.dynamic_sampling_rounds is not None:
            result = dynamic_sampling.fill_batch(
                generate, gen_mfc, prompts, lambda pos: datasets.collate([examples[p] for p in pos], "prompt"),
                len(examples), None, 0, step, seed, lambda flag: flag)
            ds_stats.append(result.stats | {"n_seqs": result.batch.n_seqs})
            batch = result.batch
        else:
            batch = generate(prompts, 0).batch
        with torch.no_grad():
            train_layout = logprobs(model, batch, "seqs")
            answer = ~batch["prompt_mask"].bool()
            gen = train_layout + mismatch * torch.randn(batch.n_tokens, generator=noise) * answer
            batch = batch.with_keys(tokens={"logprobs": gen, "prox_logprobs": train_layout,
                                            "ref_logprobs": logprobs(ref, batch, "seqs")})
        batch, _ = grpo.prepare_train(batch, c, state, step)
        for _ in range(epochs):  # the second update is off-policy: the ratios (and their clipping) matter
            loss, _ = grpo.loss("actor_train", batch, {"logprobs": logprobs(model, batch, "seqs")}, c, state)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scores.append(sampled[0])
    return scores, ds_stats


def gain(scores):
    return sum(scores[-10:]) / 10 - sum(scores[:5]) / 5


def assert_learns(tokenizer, algo_keys: dict, **kw) -> list[dict]:
    """Each seed's gain > 0.05 and their mean > 0.10; returns every step's dynamic-sampling statistics."""
    gains, stats = [], []
    for seed in SEEDS:
        scores, seed_stats = variant_rewards(tokenizer, algo_keys, seed=seed, **kw)
        gains.append(gain(scores))
        stats += seed_stats
    print(f"\n{algo_keys} {kw}: gains {[round(g, 3) for g in gains]}, mean {sum(gains) / len(gains):.3f}")  # -s
    assert min(gains) > 0.05 and sum(gains) / len(gains) > 0.10, gains
    return stats


@pytest.mark.scale
def test_dapo_learns_with_dynamic_sampling_keeping_every_batch_full(tokenizer):
    stats = assert_learns(tokenizer, {"clip_eps_low": 0.2, "clip_eps_high": 0.28, "loss_agg": "token_mean",
                                      "kl_coef": 0.0, "dynamic_sampling": True, "max_sampling_rounds": 3},
                          reward_fn="sort_pass", epochs=2)
    assert len(stats) == STEPS * len(SEEDS) and all(s["n_seqs"] == PROMPTS * GROUP for s in stats)  # every batch full
    rounds = [s["actor_gen/dynamic_sampling_rounds"] for s in stats]
    dropped = [s["actor_gen/dynamic_sampling_dropped"] for s in stats]
    assert max(dropped) > 0 and all((r >= 1) == (d > 0) for r, d in zip(rounds, dropped)), (rounds, dropped)
    assert all(r <= 3 for r in rounds)
    # The refill works: a slot still all-equal after 3 rounds (it keeps its first group) is rare. Measured: one
    # slot of 8, once in 150 steps, against a mean dropped share of 0.18.
    unfilled = [s["actor_gen/dynamic_sampling_unfilled"] for s in stats]
    assert all(u <= d for u, d in zip(unfilled, dropped))
    assert sum(unfilled) < 0.05 * sum(dropped), (unfilled, dropped)


@pytest.mark.scale
def test_rloo_learns(tokenizer):
    assert_learns(tokenizer, {"advantage": "rloo", "kl_coef": 0.0})


@pytest.mark.scale
def test_dr_grpo_learns(tokenizer):
    assert_learns(tokenizer, {"advantage": "dr_grpo", "loss_agg": "seq_mean_token_sum_norm", "kl_coef": 0.0})


@pytest.mark.scale
def test_gspo_learns(tokenizer):
    # Two updates per batch: on the first the ratio is 1 and GSPO's gradient is GRPO's (seq_mean); on the second
    # the sequence ratios move and GSPO's clip (3e-4 / 4e-4) cuts sequences out.
    assert_learns(tokenizer, {"policy_loss": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}, epochs=2)


@pytest.mark.scale
def test_reinforce_pp_learns(tokenizer):
    assert_learns(tokenizer, {"advantage": "reinforce_pp", "kl_in_reward": True, "loss_agg": "token_mean"})


@pytest.mark.scale
def test_reinforce_pp_baseline_learns(tokenizer):
    assert_learns(tokenizer, {"advantage": "reinforce_pp_baseline", "loss_agg": "token_mean"})


@pytest.mark.scale
def test_importance_sampling_tis_learns_across_a_layout_mismatch(tokenizer):
    assert_learns(tokenizer, {"is_correction": "tis", "is_cap": 2.0}, mismatch=0.05)
