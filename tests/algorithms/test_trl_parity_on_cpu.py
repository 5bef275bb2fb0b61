"""restage's GRPO-family losses equal TRL's GRPOTrainer's, loss and gradients, on one fixed batch (issue 31).

TRL is a test-only extra (``trl==1.16.0`` in setup.cfg's ``test``: it adds nothing else to the test venv), never a
dependency of restage; its loss runs in a child process (tests/algorithms/trl_loss.py), so this test's process never
imports it. Without TRL in the test venv the child runs in bench/.venv-trl (bench/e2e_cpu.py's), and without either
these tests skip and say so.

Each case maps one TRL setting onto restage's config keys:

* ``loss_type="grpo"`` (per-sequence token mean, then mean over sequences) -> ``loss_agg: seq_mean``;
* ``"bnpo"`` (token mean over the batch) -> ``loss_agg: token_mean``;
* ``"dr_grpo"`` (token sum over ``n_seqs * max_completion_length``) -> ``loss_agg: seq_mean_token_sum_norm``;
* ``"dapo"`` (token sum over the generation batch's tokens; here one micro-batch on one process, so the token mean),
  with the decoupled clip ``epsilon=0.2, epsilon_high=0.28`` -> ``token_mean``, ``clip_eps_low/high``;
* ``importance_sampling_level="sequence"`` with ``loss_type="grpo"`` (GSPO, its clip 3e-4/4e-4) ->
  ``policy_loss: gspo``, ``seq_mean``.

All with ``beta=0.04`` (k3 KL per token, as restage's GRPO ``kl_coef``/``kl_estimator: k3``; TRL's
``use_bias_correction_kl``, on by default in 1.16, weights the KL by the ratio, so it is set off) and once with ``beta=0``.
"""

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_loop import logprobs, tiny_model

from restage.algorithms.interface import get_algorithm
from restage.config.load import config_from_dict
from restage.data.batch import pack_sequences

ROOT = Path(__file__).resolve().parents[2]
BENCH_TRL_PYTHON = ROOT / "bench" / ".venv-trl" / "bin" / "python"
TOKENIZER = ROOT / "data" / "synthetic" / "tokenizer"
GROUP, PROMPT, WIDTH = 4, 5, 7

# name: (TRL loss_type, importance_sampling_level, epsilon, epsilon_high, beta), restage algo keys
CASES = {
    "grpo": (("grpo", "token", 0.2, 0.2, 0.04), {"loss_agg": "seq_mean"}),
    "grpo_no_kl": (("grpo", "token", 0.2, 0.2, 0.0), {"loss_agg": "seq_mean"}),
    "bnpo": (("bnpo", "token", 0.2, 0.2, 0.04), {"loss_agg": "token_mean"}),
    "dr_grpo": (("dr_grpo", "token", 0.2, 0.2, 0.04), {"loss_agg": "seq_mean_token_sum_norm"}),
    "dapo": (("dapo", "token", 0.2, 0.28, 0.04), {"loss_agg": "token_mean", "clip_eps_low": 0.2, "clip_eps_high": 0.28}),
    "gspo": (("grpo", "sequence", 3e-4, 4e-4, 0.04),
             {"loss_agg": "seq_mean", "policy_loss": "gspo", "clip_eps_low": 3e-4, "clip_eps_high": 4e-4}),
}


def fixed_batch(model):
    """8 answers (2 groups of 4) with prompts of one length and answers of 3..7 tokens; the old log-probs are the
    model's plus noise: 1e-5 on the first group (every ratio inside the clip, GSPO's 3e-4 too), 0.3 on the second
    (token ratios clipped in part, GSPO's sequence ratios outside its clip)."""
    g = torch.Generator().manual_seed(3)
    n = 2 * GROUP
    prompts = torch.randint(3, 16, (n, PROMPT), generator=g)
    prompts[:, 0] = 1  # BOS
    completions = torch.randint(3, 16, (n, WIDTH), generator=g)
    lengths = torch.tensor([7, 5, 3, 6, 7, 4, 6, 3])
    completion_mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
    completions = completions * completion_mask  # pad 0 past each answer
    seqs = [prompts[i].tolist() + completions[i, :lengths[i]].tolist() for i in range(n)]
    batch = pack_sequences(seqs, group_size=1, prompt_lens=[PROMPT] * n)
    with torch.no_grad():
        current = logprobs(model, batch, "seqs")
    answer = ~batch["prompt_mask"].bool()
    scale = torch.cat([torch.full((GROUP,), 1e-5), torch.full((GROUP,), 0.3)])
    seq_of = torch.repeat_interleave(torch.arange(n), torch.tensor(batch.seqlens))
    old = (current + torch.randn(batch.n_tokens, generator=g) * scale[seq_of]) * answer
    ref = (current + 0.3 * torch.randn(batch.n_tokens, generator=g)) * answer
    advantages = torch.randn(n, generator=g)
    # One token with ratio 1.25 and a positive advantage: inside DAPO's upper clip 1.28, outside the symmetric 1.2.
    first = int(torch.nonzero(answer & (seq_of == GROUP))[0])
    old[first] = current[first] - math.log(1.25)
    advantages[GROUP] = 1.0
    padded = {"prompt_ids": prompts, "prompt_mask": torch.ones(n, PROMPT, dtype=torch.long),
              "completion_ids": completions, "completion_mask": completion_mask, "advantages": advantages,
              "old_per_token_logps": torch.zeros(n, WIDTH), "ref_per_token_logps": torch.zeros(n, WIDTH)}
    for i in range(n):
        positions = torch.nonzero(answer & (seq_of == i)).squeeze(-1)
        padded["old_per_token_logps"][i, :lengths[i]] = old[positions]
        padded["ref_per_token_logps"][i, :lengths[i]] = ref[positions]
    packed = batch.with_keys(tokens={"logprobs": old, "ref_logprobs": ref,
                                     "advantages": advantages[seq_of] * answer})
    return padded, packed


def restage_loss(model, packed, keys, beta):
    cfg = config_from_dict({"experiment": "x", "algorithm": "grpo", "reward_fn": "sort",
                            "models": {"actor": {"path": "p"}, "ref": {"path": "p"}},
                            "generation": {"max_new_tokens": WIDTH},
                            "algo": {"group_size": GROUP, "kl_coef": beta, "kl_estimator": "k3", **keys}})
    grpo = get_algorithm("grpo")
    state = grpo.init_state(cfg)
    model.zero_grad()
    loss, _ = grpo.loss("actor_train", packed, {"logprobs": logprobs(model, packed, "seqs")}, cfg, state)
    loss.backward()
    return loss.detach(), {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def trl_interpreter() -> str | None:
    """The Python that has TRL: this test venv's (the test extra), else the benchmark's TRL venv, else None."""
    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    return str(BENCH_TRL_PYTHON) if BENCH_TRL_PYTHON.is_file() else None


@pytest.fixture(scope="module")
def trl_results(tmp_path_factory):
    trl_python = trl_interpreter()
    if trl_python is None:
        pytest.skip(f"TRL is not installed: `make install` puts trl==1.16.0 in the test venv (or make {BENCH_TRL_PYTHON})")
    work = tmp_path_factory.mktemp("trl")
    model = tiny_model(seed=5)
    model.save_pretrained(work / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, work / "model" / name)
    padded, packed = fixed_batch(model)
    torch.save(padded, work / "batch.pt")
    cases = [{"name": name, "loss_type": t[0], "level": t[1], "epsilon": t[2], "epsilon_high": t[3], "beta": t[4]}
             for name, (t, _) in CASES.items()]
    args = {"model": str(work / "model"), "batch": str(work / "batch.pt"), "out": str(work / "out.pt"),
            "group_size": GROUP, "cases": cases}
    done = subprocess.run([trl_python, str(Path(__file__).with_name("trl_loss.py")), json.dumps(args)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return model, packed, torch.load(work / "out.pt")


@pytest.mark.parametrize("name", list(CASES))
def test_grpo_dr_grpo_dapo_gspo_losses_and_gradients_equal_trls(trl_results, name):
    model, packed, trl = trl_results
    (_, _, _, _, beta), keys = CASES[name]
    loss, grads = restage_loss(model, packed, keys, beta)
    want = trl[name]
    assert float(loss) == pytest.approx(float(want["loss"]), abs=1e-5), (float(loss), float(want["loss"]))
    assert grads.keys() == want["grads"].keys()
    worst = max(float((grads[k] - want["grads"][k]).abs().max()) for k in grads)
    scale = max(float(g.abs().max()) for g in grads.values())
    assert worst < 1e-5 and scale > 1e-3, (name, worst, scale)  # a real gradient, equal to TRL's
    if name == "dapo":  # the decoupled clip matters on this batch: the symmetric one's gradient is another
        _, symmetric = restage_loss(model, packed, {"loss_agg": "token_mean"}, beta)
        assert max(float((symmetric[k] - grads[k]).abs().max()) for k in grads) > 1e-4
    if name == "gspo":  # and so does the sequence-level ratio
        _, token_level = restage_loss(model, packed, {"loss_agg": "seq_mean"}, beta)
        assert max(float((token_level[k] - grads[k]).abs().max()) for k in grads) > 1e-4
