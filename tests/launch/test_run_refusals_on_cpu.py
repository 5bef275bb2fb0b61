"""`restage run` refuses, in one line and before any rank starts, data that no rank could use: prompts that with the
generated tokens (or answers) pass the model's positions, and a data file that is not UTF-8."""

import time
from pathlib import Path

import pytest

from restage.cli import main as restage_main
from restage.config.load import load_config
from restage.data.datasets import Dataset, Example, check_positions
from restage.demo import ensure_tiny_model
from restage.errors import ConfigError
from restage.launch.local import prepare

ROOT = Path(__file__).resolve().parents[2]
# BOS + 4 and BOS + 8 tokens (the shipped tokenizer: one token per word); tiny-llama has 64 positions.
PROMPTS = ['{"prompt": "sort 1 2 :"}\n', '{"prompt": "sort 1 2 3 4 5 6 :"}\n']


@pytest.fixture
def run(tmp_path, monkeypatch, capsys):
    """``restage run jobs/ppo_tiny.yaml`` on a data set of PROMPTS (as bytes ``data``): (exit code, stderr lines,
    seconds)."""
    ensure_tiny_model(ROOT)
    monkeypatch.chdir(ROOT)

    def call(*overrides, data: bytes = "".join(PROMPTS).encode()):
        path = tmp_path / "prompts.jsonl"
        path.write_bytes(data)
        started = time.monotonic()
        code = restage_main(["run", "jobs/ppo_tiny.yaml", "-n", "2", f"run.results_dir={tmp_path}", "run.batch_size=2",
                             f"dataset.path={path}", *overrides])
        return code, capsys.readouterr().err.strip().splitlines(), time.monotonic() - started

    return call


def test_a_prompt_that_with_the_new_tokens_passes_the_positions_is_refused_before_ranks(run, tmp_path):
    code, err, seconds = run("generation.max_new_tokens=60")
    assert code == 2 and err == [
        f"restage: error: {tmp_path / 'prompts.jsonl'}:2: the prompt is 9 tokens, and with generation.max_new_tokens "
        "60 a sequence reaches 69, but models.actor has 64 positions (max_position_embeddings); set "
        "dataset.max_prompt_tokens <= 4 (prompts are cut from the left) or lower generation.max_new_tokens"]
    assert seconds < 20 and not (tmp_path / "ppo-tiny" / "default" / "log.h5").exists()  # no rank started
    code, err, _ = run("generation.max_new_tokens=64")
    assert code == 2 and err == ["restage: error: generation.max_new_tokens 64 leaves no room for a prompt: "
                                 "models.actor has 64 positions (max_position_embeddings); lower it"]
    for fits in (["generation.max_new_tokens=55"], ["generation.max_new_tokens=60", "dataset.max_prompt_tokens=4"]):
        prepare(load_config(ROOT / "jobs/ppo_tiny.yaml", [f"run.results_dir={tmp_path}", "run.batch_size=2",
                                                          f"dataset.path={tmp_path / 'prompts.jsonl'}", *fits]))


def test_a_data_file_that_is_not_utf8_is_refused_before_ranks(run, tmp_path):
    data = PROMPTS[0].encode() + b'{"prompt": "sort 1 \xe9 :"}\n'
    code, err, seconds = run(data=data)
    assert code == 2 and err == [f"restage: error: {tmp_path / 'prompts.jsonl'}:2: not UTF-8 (byte "
                                 f"{data.index(0xE9)} of the file, 0xe9); save the file as UTF-8"]
    assert seconds < 20 and not (tmp_path / "ppo-tiny" / "default" / "log.h5").exists()


def test_prompt_plus_answer_past_the_positions_is_refused():
    cfg = load_config(ROOT / "jobs/sft_tiny.yaml", ["dataset.max_prompt_tokens=20", "dataset.max_answer_tokens=50"])
    data = Dataset("sft", (Example(0, (1,) * 9, ((5,) * 7,)), Example(1, (1,) * 20, ((5,) * 50,))))
    with pytest.raises(ConfigError) as err:
        check_positions(cfg, [data], {"actor": 64})
    assert str(err.value) == (f"{ROOT / 'data/synthetic/sft.jsonl'}:2: prompt and answer are 20 + 50 = 70 tokens, but models.actor "
                              "has 64 positions (max_position_embeddings); lower dataset.max_prompt_tokens and "
                              "dataset.max_answer_tokens to sum to <= 64")
    check_positions(cfg, [data], {"actor": 70})


def test_a_plan_for_gpus_is_refused_on_a_machine_without_cuda(run, tmp_path):
    code, err, seconds = run("cluster.name=h100-80gb")
    assert code == 2 and err == ["restage: error: cluster.name=h100-80gb plans for NVIDIA H100-SXM5-80GB GPUs but this "
                                 "machine has no CUDA device; set cluster.name=local-cpu to run here, or submit to GPU "
                                 "nodes (restage submit)"]
    assert seconds < 20 and not (tmp_path / "ppo-tiny" / "default" / "log.h5").exists()


def test_a_plan_for_cpus_on_a_machine_with_gpus_is_run_with_a_warning():
    from restage.launch.local import check_local_devices

    cfg = load_config(ROOT / "jobs/ppo_tiny.yaml")
    assert check_local_devices(cfg, 0) == ""
    assert check_local_devices(cfg, 8) == (
        "warning: the ranks will run on this machine's 8 CUDA device(s) with a plan costed for cluster.name=local-cpu "
        "(AMD EPYC core, CPU); set cluster.name to a GPU cluster file (cluster/*.yaml) to plan for them")
    gpu = load_config(ROOT / "jobs/ppo_tiny.yaml", ["cluster.name=h100-80gb"])
    assert check_local_devices(gpu, 1) == ""
