"""``restage generate`` in one process: its completions are the library's."""

from __future__ import annotations

import json
from pathlib import Path

from model_cases import PROMPTS

from restage.cli import main as restage
from restage.config.load import load_config
from restage.data.datasets import load_splits
from restage.data.tokenizer import load_tokenizer
from restage.demo import ensure_tiny_model
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage
from restage.rollout.generation import generate
from restage.rollout.sampling import SamplingParams


def test_json_completions_equal_library_generation(tiny_models, capsys):
    path = tiny_models["gpt2"]
    argv = ["generate", path, "--max-new-tokens", "6", "--greedy", "--json", "--prompt", "the cat sat"]
    argv += [arg for p in PROMPTS[:2] for arg in ("--token-ids", " ".join(map(str, p)))]
    assert restage(argv) == 0
    out = json.loads(capsys.readouterr().out)
    completions = out["completions"]
    assert out["strategy"] == "dp1tp1pp1" and len(completions) == 3
    bos = load_tokenizer(path).bos_token_id
    assert completions[0]["prompt"] == "the cat sat" and completions[0]["prompt_token_ids"] == [bos, 4, 106, 108]
    module = load_stage(path, Layout((0,), Strategy()), None, 0)
    prompts = [c["prompt_token_ids"] for c in completions]
    assert prompts[1:] == PROMPTS[:2]
    expected = generate(module, prompts, SamplingParams(max_new_tokens=6, greedy=True, eos_token_ids=(2,)))
    assert [c["token_ids"] for c in completions] == expected.sequences()
    assert all(len(c["text"].split()) == len(c["token_ids"]) for c in completions if 2 not in c["token_ids"])


def test_text_output_reads_prompts_from_jsonl(tiny_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n\n{"token_ids": [5, 6, 7]}\n')
    assert restage(["generate", "--model", tiny_models["llama"], "--prompts", str(prompts), "--max-new-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].startswith("[0] hello world -> ") and lines[1].startswith("[1] 5 6 7 -> ")


def test_text_prompts_are_encoded_as_training_encodes_them(tmp_path, capsys):
    """BOS first (the synthetic task's tokenizer adds none itself), cut from the left like dataset.max_prompt_tokens."""
    root = Path(__file__).resolve().parents[2]
    model = ensure_tiny_model(root)
    texts = ["sort 3 1 2 :", "sort 9 8 7 6 5 4 :"]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    for cut in (0, 5):
        argv = ["generate", str(root / model), "--greedy", "--json", "--max-new-tokens", "2", "--prompts", str(data)]
        assert restage(argv + (["--max-prompt-tokens", str(cut)] if cut else [])) == 0
        generated = [c["prompt_token_ids"] for c in json.loads(capsys.readouterr().out)["completions"]]
        cfg = load_config(root / "jobs" / "ppo_tiny.yaml", [f"dataset.path={data}", f"dataset.max_prompt_tokens={cut or 64}",
                                                            f"dataset.tokenizer={root / 'data/synthetic/tokenizer'}"])
        train, _ = load_splits(cfg)
        assert generated == [list(e.prompt) for e in train.examples]
        assert [p[0] for p in generated] == [1, 1] and [len(p) for p in generated] == ([6, 9] if not cut else [5, 5])
