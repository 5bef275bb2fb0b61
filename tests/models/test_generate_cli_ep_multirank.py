"""``restage generate --ep 2`` on two ranks (a Mixtral's or a Qwen3-MoE's experts split over two data-parallel
replicas) gives transformers' greedy tokens in its ``--json`` output; an ep that does not divide the experts is one
line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from model_cases import PROMPTS

pytestmark = pytest.mark.multirank

NEW_TOKENS = 8


def _run(path, *extra):
    argv = [sys.executable, "-m", "restage.cli", "generate", path, "--max-new-tokens", str(NEW_TOKENS), "--greedy",
            "--json", *extra]
    argv += [arg for p in PROMPTS[:3] for arg in ("--token-ids", " ".join(map(str, p)))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _tiny(tmp_path_factory, family: str) -> str:
    from restage.models.tiny import build_tiny

    return str(build_tiny(tmp_path_factory.mktemp("moe") / family, family=family, seed=11))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    return _tiny(tmp_path_factory, "mixtral")


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_ep2_on_two_ranks_gives_transformers_greedy_tokens(tmp_path_factory, family):
    from model_cases import hf_greedy

    path = _tiny(tmp_path_factory, family)
    done = _run(path, "--ep", "2", "-n", "2")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["strategy"] == "dp2ep2tp1pp1"
    reference = hf_greedy(path, PROMPTS[:3], NEW_TOKENS)
    eos = 2  # the tiny models' EOS: the CLI stops there, transformers (asked for no EOS) runs on
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in reference]
    assert [c["token_ids"] for c in out["completions"]] == expected


def test_ep_that_does_not_divide_the_experts_is_refused_in_one_line(mixtral):
    done = _run(mixtral, "--ep", "3", "-n", "3")
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and "ep=3 does not divide its 4 experts" in line, line
