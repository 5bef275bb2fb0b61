"""Single-rank checkpoint round trips and slice reads (multi-rank saves are in test_layouts_multirank.py)."""

from __future__ import annotations

import json

import pytest
import torch
from model_cases import sample_sequences

from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import WeightReader, load_stage, save_checkpoint
from restage.models.packing import pack

ONE_RANK = Layout((0,), Strategy())


@pytest.mark.parametrize("name", ["llama_tied", "mistral", "gpt2", "qwen3"])  # sharded index, .bin, fused GPT-2, q/k norms
def test_single_rank_save_reloads_in_transformers_with_the_same_weights(tiny_models, tmp_path, name):
    from restage.models.tiny import load_hf

    module = load_stage(tiny_models[name], ONE_RANK, None, 0)
    save_checkpoint(module, tmp_path / name, tokenizer_from=tiny_models[name])
    assert (tmp_path / name / "model.safetensors").is_file() and (tmp_path / name / "generation_config.json").is_file()
    original, saved = load_hf(tiny_models[name]).state_dict(), load_hf(tmp_path / name).state_dict()
    assert original.keys() == saved.keys()
    assert all(torch.equal(original[k], saved[k]) for k in original)


def test_critic_started_from_a_causal_lm_saves_as_sequence_classification(tiny_models, tmp_path):
    from restage.models.tiny import load_hf

    critic = load_stage(tiny_models["llama"], ONE_RANK, None, 0, critic=True)
    again = load_stage(tiny_models["llama"], ONE_RANK, None, 0, critic=True)
    assert torch.equal(critic.score.weight, again.score.weight) and critic.score.weight.abs().sum() > 0
    seqs = sample_sequences([6, 10], seed=8)
    tokens, batch = pack(seqs)
    with torch.no_grad():
        values = critic(tokens, batch)
    assert values.shape == (16,)
    save_checkpoint(critic, tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and config["num_labels"] == 1
    hf = load_hf(tmp_path / "critic")
    with torch.no_grad():
        scores = [hf(torch.tensor([s])).logits.item() for s in seqs]
    assert torch.allclose(values[batch.last_token_index()], torch.tensor(scores), atol=1e-5)


def test_reader_counts_only_the_bytes_of_the_slices_it_fetches(tiny_models):
    reader = WeightReader(tiny_models["llama"])
    assert reader.shape("model.embed_tokens.weight") == (257, 64)
    rows = reader.read("model.embed_tokens.weight", (slice(10, 20), slice(0, 64)))
    assert rows.shape == (10, 64) and reader.bytes_read == 10 * 64 * 4
    full = reader.read("model.embed_tokens.weight")
    assert torch.equal(full[10:20], rows) and reader.bytes_read == (10 + 257) * 64 * 4
