"""``restage generate`` under mpirun with tp=2 and two data-parallel replicas gives the one-process completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
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
