"""The larger GRPO job of bench/e2e_cpu.py has the shape issue 20 asks for, and its model is what the job names; the GPU
costs job of scripts/gpu_check.sh (jobs/gpu_ppo_300m.yaml) plans on CPU with the model restage.demo builds for it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import restage.demo
from restage.algorithms.interface import build_graph
from restage.config.load import load_config
from restage.demo import LLAMA_300M_SIZES, ensure_llama_256x4, ensure_llama_300m
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.models.tiny import tiny_hf_config
from restage.plan.planner import make_plan

REPO = Path(__file__).resolve().parents[2]


def test_the_256x4_job_and_model_have_the_benchmarks_shape(tmp_path):
    cfg = load_config(REPO / "jobs" / "grpo_256x4.yaml")
    assert (cfg.algorithm, cfg.algo["group_size"], cfg.run.batch_size, cfg.algo["kl_coef"]) == ("grpo", 4, 4, 0.0)
    assert (cfg.generation.max_new_tokens, cfg.generation.temperature, cfg.generation.greedy) == (64, 1.0, False)
    assert [m.name for m in build_graph(cfg)] == ["actor_gen", "actor_train"]  # KL 0: no reference pass
    (tmp_path / "data" / "synthetic").mkdir(parents=True)
    (tmp_path / "data" / "synthetic" / "tokenizer").symlink_to(REPO / "data" / "synthetic" / "tokenizer")
    path = ensure_llama_256x4(tmp_path)
    assert path.relative_to(tmp_path) == Path(cfg.models["actor"].path).relative_to(REPO)  # the job's, in the repo
    hf = json.loads((path / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"], hf["eos_token_id"]) == (256, 4, 16, 2)
    assert hf["max_position_embeddings"] >= cfg.dataset.max_prompt_tokens + cfg.generation.max_new_tokens
    tokenizer = {f.name for f in (REPO / "data" / "synthetic" / "tokenizer").iterdir()}
    assert tokenizer and tokenizer <= {f.name for f in path.iterdir()}  # the job's tokenizer sits beside the weights


def test_the_gpu_costs_job_plans_on_cpu_for_one_h200_with_the_model_demo_builds(tmp_path, monkeypatch):
    built = {}

    def config_only(path, family, seed, vocab_size, tokenizer, dtype, **sizes):  # the 0.6 GB of weights are not needed
        built.update(family=family, vocab_size=vocab_size, dtype=dtype, **sizes)
        tiny_hf_config(family, vocab_size=vocab_size, **sizes).save_pretrained(path)

    monkeypatch.setattr(restage.demo, "build_tiny", config_only)
    (tmp_path / "data").symlink_to(REPO / "data")
    monkeypatch.chdir(tmp_path)
    path = ensure_llama_300m(tmp_path)
    job = REPO / "jobs" / "gpu_ppo_300m.yaml"
    assert {Path(spec.path).relative_to(REPO) for spec in load_config(job).models.values()} == {path.relative_to(tmp_path)}
    cfg = load_config(job, [f"models.{name}.path={path}" for name in ("actor", "critic", "ref")])
    assert built == dict(family="llama", vocab_size=16, dtype=torch.bfloat16, **LLAMA_300M_SIZES)
    arch = ModelConfig.from_pretrained(path)
    params = arch.num_layers * block_shape(arch, 1).weight_params
    assert 3.0e8 < params < 3.1e8  # 12 x 25.2M
    assert arch.max_positions >= cfg.dataset.max_prompt_tokens + cfg.generation.max_new_tokens
    assert cfg.generation.min_new_tokens == cfg.generation.max_new_tokens  # every answer as long as the estimate's
    assert {spec.dtype for spec in cfg.models.values()} == {"bf16"}
    outcome = make_plan(cfg)
    assert (outcome.problem.cluster.name, outcome.problem.cluster.world_size) == ("h200-141gb", 1)
    names = [c.mfc for c in outcome.plan]
    assert names == ["actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train"]
    # sized so that a step takes seconds on the GPU: 1 to 5 s predicted, 6-8 steps in the check's few minutes
    assert 1.0 <= outcome.evaluation.iteration_seconds <= 5.0
