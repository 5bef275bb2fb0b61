"""The larger GRPO job of bench/e2e_cpu.py has the shape issue 20 asks for, and its model is what the job names."""

from __future__ import annotations

import json
from pathlib import Path

from restage.algorithms.interface import build_graph
from restage.config import load_config
from restage.demo import ensure_llama_256x4

REPO = Path(__file__).resolve().parents[2]


def test_the_256x4_job_and_model_have_the_benchmarks_shape(tmp_path):
    cfg = load_config(REPO / "jobs" / "grpo_256x4.yaml")
    assert (cfg.algorithm, cfg.algo["group_size"], cfg.run.batch_size, cfg.algo["kl_coef"]) == ("grpo", 4, 4, 0.0)
    assert (cfg.generation.max_new_tokens, cfg.generation.temperature, cfg.generation.greedy) == (64, 1.0, False)
    assert [m.name for m in build_graph(cfg)] == ["actor_gen", "actor_train"]  # KL 0: no reference pass
    (tmp_path / "data" / "synthetic").mkdir(parents=True)
    (tmp_path / "data" / "synthetic" / "tokenizer").symlink_to(REPO / "data" / "synthetic" / "tokenizer")
    path = ensure_llama_256x4(tmp_path)
    assert path == tmp_path / cfg.models["actor"].path
    hf = json.loads((path / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"], hf["eos_token_id"]) == (256, 4, 16, 2)
    assert hf["max_position_embeddings"] >= cfg.dataset.max_prompt_tokens + cfg.generation.max_new_tokens
    tokenizer = {f.name for f in (REPO / "data" / "synthetic" / "tokenizer").iterdir()}
    assert tokenizer and tokenizer <= {f.name for f in path.iterdir()}  # the job's tokenizer sits beside the weights
