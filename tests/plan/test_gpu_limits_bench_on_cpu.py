"""bench/gpu_limits.py (issue 29 item 4): the HBM roofline of decode steps, the training and prefill FLOPs, the MFU and
the targets' summary, against figures worked out by hand; its GRPO job plans on CPU for one H200 with the model
restage.demo builds for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import restage.demo
from restage.config.load import load_config
from restage.demo import LLAMA_1B_SIZES, ensure_llama_1b
from restage.models.arch import ModelConfig
from restage.models.presets import preset
from restage.models.tiny import tiny_hf_config
from restage.plan.planner import make_plan

REPO = Path(__file__).resolve().parents[2]
# llama-tiny: hidden 64, MLP 172, 2 layers, 4 heads and 2 KV heads of 16, vocabulary 512. One block's matrices:
# q and o 64 x 64 each, k and v 32 x 64 each, gate, up and down 64 x 172 each: 12,288 + 33,024 = 45,312 elements.
TINY_BLOCK = 64 * 64 * 2 + 32 * 64 * 2 + 3 * 64 * 172


@pytest.fixture(scope="module")
def bench(bench_module):
    return bench_module("gpu_limits")


def test_a_decode_step_reads_every_weight_matrix_once(bench):
    assert TINY_BLOCK == 45_312
    assert bench.weight_bytes(preset("llama-tiny"), "bf16") == (2 * 45_312 + 512 * 64) * 2 == 246_784
    assert bench.weight_bytes(preset("llama-tiny"), "fp32") == 493_568
    assert bench.kv_bytes_per_token(preset("llama-tiny"), "bf16") == 2 * 2 * 2 * 16 * 2 == 256


def test_the_kv_bytes_grow_by_one_position_a_step(bench):
    # 4 sequences of 10 prompt tokens, answer steps 0, 1, 2: they attend to 10, 11 and 12 positions.
    traffic = bench.decode_bytes(246_784, 256, sequences=4, prompt_tokens=10, first_step=0, steps=3)
    assert (traffic.weight_bytes, traffic.kv_bytes) == (3 * 246_784, 4 * (10 + 11 + 12) * 256) == (740_352, 33_792)
    assert traffic.total_bytes == 774_144
    later = bench.decode_bytes(246_784, 256, sequences=4, prompt_tokens=10, first_step=1, steps=3)
    assert later.kv_bytes == 4 * (11 + 12 + 13) * 256 == 36_864
    assert bench.roofline_fraction(774_144, 1e6, 1.548288) == pytest.approx(0.5)


def test_the_1b_model_at_512_sequences_reads_more_kv_than_weights(bench):
    w = bench.WORKLOADS["1b"]
    # 16 blocks of 2048 x (2 x 2048 + 2 x 512) + 3 x 2048 x 8192 = 60,817,408 elements, and a 32,000 x 2048 head.
    assert bench.weight_bytes(w.arch, "bf16") == (16 * 60_817_408 + 32_000 * 2048) * 2 == 2_077_229_056
    assert bench.kv_bytes_per_token(w.arch, "bf16") == 2 * 16 * 8 * 64 * 2 == 32_768
    # Answer steps 1 .. 255 after 64-token prompts: 255 x 64 + (1 + ... + 255) = 48,960 positions per sequence.
    traffic = bench.decode_bytes(2_077_229_056, 32_768, sequences=512, prompt_tokens=64, first_step=1, steps=255)
    assert traffic.kv_bytes == 512 * 48_960 * 32_768
    assert traffic.weight_bytes == 255 * 2_077_229_056
    # At an H200's 4.8 TB/s the 255 steps take at least 0.281 s: 464k tokens/s is the roofline.
    assert traffic.total_bytes / 4.8e12 == pytest.approx(0.28148, rel=1e-4)


def test_training_counts_three_forwards_with_causal_attention(bench):
    cfg = preset("llama-tiny")
    # 2 sequences of 7 tokens: 14 tokens attending to (7 + 1) / 2 = 4 keys on average.
    per_layer = 2 * 14 * TINY_BLOCK + 4 * 14 * 4 * 64
    head = 2 * 14 * 64 * 512
    assert bench.train_flops(cfg, sequences=2, seq_tokens=7) == 3 * (2 * per_layer + head) == 10_450_944
    assert bench.prefill_flops(cfg, sequences=2, tokens=7) == 2 * per_layer == 2_566_144  # no logits in a prefill
    assert bench.mfu(10_450_944, 0.5, 1e8) == pytest.approx(0.20901888)


def test_the_summary_compares_the_worst_case_at_128_or_more_sequences_with_each_target(bench):
    cases = [{"cache": "paged", "concurrency": 32, "roofline_fraction": 0.2},
             {"cache": "paged", "concurrency": 128, "roofline_fraction": 0.75},
             {"cache": "paged", "concurrency": 512, "roofline_fraction": 0.72},
             {"cache": "contiguous", "concurrency": 128, "roofline_fraction": 0.69},
             {"cache": "contiguous", "concurrency": 512, "roofline_fraction": None}]
    s = bench.summary({"decode": {"cases": cases}, "train": {"mfu": 0.41}, "grpo": {"step_error_percent": -15.5}})
    assert s["decode_min_roofline_fraction_at_128_plus"] == {"paged": 0.72, "contiguous": 0.69}
    assert s["decode_target_met"] == {"paged": True, "contiguous": False}
    assert (s["train_target_met"], s["grpo_target_met"]) == (True, False)
    assert bench.summary({})["train_target_met"] is None  # not measured yet


def test_the_grpo_job_plans_on_cpu_for_one_h200_with_the_model_demo_builds(bench, tmp_path, monkeypatch):
    built = {}

    def config_only(path, family, seed, vocab_size, tokenizer, dtype, **sizes):  # the 1.9 GB of weights are not needed
        built.update(family=family, vocab_size=vocab_size, dtype=dtype, **sizes)
        tiny_hf_config(family, vocab_size=vocab_size, **sizes).save_pretrained(path)

    monkeypatch.setattr(restage.demo, "build_tiny", config_only)
    (tmp_path / "data").symlink_to(REPO / "data")
    monkeypatch.chdir(tmp_path)
    path = ensure_llama_1b(tmp_path)
    w = bench.WORKLOADS["1b"]
    job = REPO / w.job
    assert {Path(spec.path).relative_to(REPO) for spec in load_config(job).models.values()} == {path.relative_to(tmp_path)}
    cfg = load_config(job, [f"models.{name}.path={path}" for name in ("actor", "ref")])
    assert built == dict(family="llama", vocab_size=16, dtype=torch.bfloat16, **LLAMA_1B_SIZES)
    arch = ModelConfig.from_pretrained(path)
    # The bench's decode, prefill and training model is the job's backbone over a 32,000-token vocabulary.
    same = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    assert [getattr(arch, k) for k in same] == [getattr(w.arch, k) for k in same]
    assert (cfg.algorithm, cfg.algo["group_size"], cfg.run.batch_size) == ("grpo", 8, 16)
    assert cfg.generation.min_new_tokens == cfg.generation.max_new_tokens == w.answer_tokens == 256
    assert {spec.dtype for spec in cfg.models.values()} == {"bf16"}
    outcome = make_plan(cfg)
    assert [c.mfc for c in outcome.plan] == ["actor_gen", "ref_inf", "actor_train"]
    assert {c.layout.strategy.world_size for c in outcome.plan} == {1}
    # About 1.6 s a step predicted on one H200 (a whole GRPO step in seconds, so 6 steps fit the part's budget),
    # within its memory.
    assert 0.8 < outcome.evaluation.iteration_seconds < 3.2
    assert outcome.evaluation.peak_memory_bytes < outcome.evaluation.capacity_bytes
