"""scripts/gpu_check.sh's `sizes` part (issue 30 item 3): three real RL jobs, one per size, their measured seconds per
MFC beside the estimator's in one sizes.json. On CPU (`sizes-cpu`) the same jobs run over tiny stand-ins, end to end;
the GPU jobs themselves are checked to plan on one H200 with the models restage.demo builds for them (config only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import restage.demo
from restage.config.load import load_config
from restage.demo import GPU_SIZE_MODELS, ensure_size_model
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.models.tiny import tiny_hf_config
from restage.plan.planner import make_plan
from restage.report.synthetic import write_synthetic_log

REPO = Path(__file__).resolve().parents[2]
JOBS = {"0p5b": "jobs/gpu_ppo_0p5b.yaml", "1p5b": "jobs/gpu_ppo_1p5b.yaml", "4b": "jobs/gpu_grpo_4b.yaml"}
MFCS = {"ppo": ["actor_gen", "ref_inf", "critic_inf", "actor_train", "critic_train"],
        "grpo": ["actor_gen", "ref_inf", "actor_train"]}


@pytest.fixture(scope="module")
def bench(bench_module):
    return bench_module("runtime_vs_estimate")


@pytest.fixture(scope="module")
def sizes_cpu(tmp_path_factory):
    """``scripts/gpu_check.sh OUT sizes-cpu`` run once, with this interpreter as the script's python3."""
    out = tmp_path_factory.mktemp("sizes")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["scripts/gpu_check.sh", str(out), "sizes-cpu"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "sizes.json").read_text())


@pytest.mark.e2e
def test_sizes_cpu_writes_every_size_with_measured_and_predicted_seconds_per_mfc(sizes_cpu):
    out, result = sizes_cpu
    assert (result["device"], result["device_name"], result["cluster"]) == ("cpu", "cpu", "local-cpu")
    assert result["torch"] and result["date"].startswith("20")
    assert [e["size"] for e in result["sizes"]] == list(JOBS)
    for entry in result["sizes"]:
        assert entry["status"] == "ok" and entry["rc"] == 0, entry.get("log_tail")
        assert entry["job"] == JOBS[entry["size"]] and 0 < entry["wall_seconds"] <= entry["budget_seconds"]
        cfg = load_config(REPO / entry["job"])
        sizes = restage.demo.CPU_SIZE_MODELS[entry["size"]]
        hidden, layers, mlp = sizes["hidden_size"], sizes["num_layers"], sizes["intermediate_size"]
        kv = hidden // sizes["num_heads"] * sizes["num_kv_heads"]
        block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * mlp + 2 * hidden  # q o, k v, MLP, two norms
        assert entry["params"] == layers * block + 2 * 16 * hidden + hidden  # embeddings, LM head, final norm
        assert entry["model_config"]["hidden_size"] == hidden
        assert entry["steps"] == 4 and entry["world_size"] == 1
        assert [m["name"] for m in entry["mfcs"]] == MFCS[cfg.algorithm]
        for m in entry["mfcs"]:
            assert m["measured_seconds"] > 0 and m["predicted_seconds"] > 0
            assert len(m["step_seconds"]) == 4 and min(m["step_seconds"]) > 0
            assert m["error"] == pytest.approx(m["predicted_seconds"] / m["measured_seconds"] - 1)
            assert m["error_percent"] == pytest.approx(100 * m["error"], abs=1e-3)  # the report's, the same sign
            assert m["peak_memory_bytes"] > 0 and m["predicted_peak_memory_bytes"] > 0
        assert entry["iteration"]["measured_seconds"] > 0 and entry["iteration"]["predicted_seconds"] > 0
    status = (out / "sizes_status.txt").read_text().split()
    assert status[::5] == list(JOBS)


def test_a_failed_size_is_recorded_and_the_others_kept(bench, tmp_path):
    log = write_synthetic_log(tmp_path / "run" / "log.h5", steps=3, world_size=2, noise=0.0)
    (tmp_path / "sizes_0p5b_runtime.json").write_text(json.dumps(bench.json_ready(bench.compare(log.parent))))
    (tmp_path / "sizes_4b_run.log").write_text("build 4b rc 0 after 70 s\ntorch.OutOfMemoryError: CUDA out of memory\n")
    (tmp_path / "sizes_status.txt").write_text("0p5b jobs/gpu_ppo_0p5b.yaml 0 60 90\n4b jobs/gpu_grpo_4b.yaml 124 180 180\n")
    assert bench.main(["--sizes", str(tmp_path), "--device", "cpu", "--cluster", "local-cpu"]) == 0
    result = json.loads((tmp_path / "sizes.json").read_text())
    ok, failed = result["sizes"]
    assert (ok["status"], ok["wall_seconds"], ok["budget_seconds"]) == ("ok", 60, 90)
    for m in ok["mfcs"]:
        assert m["error"] == pytest.approx(m["predicted_seconds"] / m["measured_seconds"] - 1)
    assert (failed["status"], failed["rc"], failed["params"]) == ("failed", 124, None)
    assert "mfcs" not in failed and failed["log_tail"][-1].startswith("torch.OutOfMemoryError")


@pytest.mark.parametrize("size", list(JOBS))
def test_each_gpu_job_plans_on_one_h200_within_memory_and_its_budget(size, tmp_path, monkeypatch):
    def config_only(path, family, seed, vocab_size, tokenizer, dtype, **sizes):  # the GBs of weights are not needed
        tiny_hf_config(family, vocab_size=vocab_size, **sizes).save_pretrained(path)

    monkeypatch.setattr(restage.demo, "build_tiny", config_only)
    (tmp_path / "data").symlink_to(REPO / "data")
    path = ensure_size_model(size, root=tmp_path)
    job = REPO / JOBS[size]
    names = load_config(job).models
    assert {Path(spec.path).relative_to(REPO) for spec in names.values()} == {path.relative_to(tmp_path)}
    cfg = load_config(job, [f"models.{name}.path={path}" for name in names])
    arch = ModelConfig.from_pretrained(path)
    assert (arch.hidden_size, arch.num_layers) == (GPU_SIZE_MODELS[size]["hidden_size"],
                                                   GPU_SIZE_MODELS[size]["num_layers"])
    params = arch.num_layers * block_shape(arch, 1).weight_params
    low, high = {"0p5b": (0.45e9, 0.55e9), "1p5b": (1.4e9, 1.6e9), "4b": (3.8e9, 4.2e9)}[size]
    assert low < params < high
    assert arch.max_positions >= cfg.dataset.max_prompt_tokens + cfg.generation.max_new_tokens
    assert cfg.generation.min_new_tokens == cfg.generation.max_new_tokens
    assert {spec.dtype for spec in cfg.models.values()} == {"bf16"}
    outcome = make_plan(cfg)
    assert (outcome.problem.cluster.name, outcome.problem.cluster.world_size) == ("h200-141gb", 1)
    assert [c.mfc for c in outcome.plan] == MFCS[cfg.algorithm]
    assert outcome.evaluation.peak_memory_bytes < 0.7 * outcome.evaluation.capacity_bytes  # room for the estimate's error
    assert 1.0 <= outcome.evaluation.iteration_seconds <= 10.0  # 4 steps in seconds, not minutes, within the budget
