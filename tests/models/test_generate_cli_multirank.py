"""``restage generate`` under mpirun with tp=2 and two data-parallel replicas gives the one-process completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from model_cases import PROMPTS, hf_greedy

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


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_under_tp2_pp2_is_token_identical_to_transformers(tiny_models, name):
    # One launch per model splits both ways at once (tp2 and pp2 alone run in test_layouts_multirank).
    done = _run(tiny_models[name], "--tp", "2", "--pp", "2")
    assert done["strategy"] == "dp1tp2pp2"
    assert [c["token_ids"] for c in done["completions"]] == hf_greedy(tiny_models[name], PROMPTS[:3], 8)
