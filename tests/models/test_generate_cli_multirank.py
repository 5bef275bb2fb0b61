"""``restage generate`` under mpirun: tp=2 with two data-parallel replicas gives the one-process completions, and
Qwen3 and Llama 3.1 (scaled RoPE) under tp=2 x pp=2 give transformers' greedy tokens and log-probabilities."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from model_cases import PROMPTS

pytestmark = pytest.mark.multirank


def _run(path, *extra):
    argv = [sys.executable, "-m", "restage.cli", "generate", path, "--max-new-tokens", "8", "--greedy", "--json", *extra]
    argv += [arg for p in PROMPTS[:3] for arg in ("--token-ids", " ".join(map(str, p)))]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_four_ranks_tp2_dp2_match_one_process(tiny_models):
    one = _run(tiny_models["qwen2_tied"])
    four = _run(tiny_models["qwen2_tied"], "--tp", "2", "-n", "4")
    assert four["strategy"] == "dp2tp2pp1"
    assert [c["token_ids"] for c in four["completions"]] == [c["token_ids"] for c in one["completions"]]
    for a, b in zip(four["completions"], one["completions"]):
        assert max(abs(x - y) for x, y in zip(a["logprobs"], b["logprobs"])) <= 1e-4


# qwen3_moe (about 27 s; mixtral covers MoE) in make test-scale only: make test's time bound
@pytest.mark.parametrize("name", ["qwen3", "llama31", "mixtral", pytest.param("qwen3_moe", marks=pytest.mark.scale)])
def test_tp2_pp2_greedy_tokens_and_logprobs_equal_transformers(tiny_models, name):
    from restage.models.tiny import load_hf

    out = _run(tiny_models[name], "--tp", "2", "--pp", "2", "--min-new-tokens", "8")
    assert out["strategy"] == "dp1tp2pp2" and len(out["completions"]) == 3
    hf = load_hf(tiny_models[name])
    for prompt, completion in zip(PROMPTS[:3], out["completions"]):
        reference = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert completion["token_ids"] == reference
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + reference])).logits[0, len(prompt) - 1:-1]
        ref_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(reference)[:, None]).squeeze(1)
        assert (torch.tensor(completion["logprobs"]) - ref_logprobs).abs().max().item() <= 1e-4
