"""LoRA on one rank: the sharding contract of adapters, the forward, PEFT-layout saves, merging, config errors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from model_cases import sample_sequences

from restage.config.load import config_from_dict
from restage.errors import CheckpointError, ConfigError
from restage.layout import Layout, Strategy
from restage.models.arch import LoraConfig, ModelConfig
from restage.models.hf_checkpoint import load_stage
from restage.models.lora_checkpoint import merge_lora, save_adapters
from restage.models.packing import pack
from restage.models.sharding import is_adapter, param_specs, shard_specs

ONE_RANK = Layout((0,), Strategy())
ALL = ("q", "k", "v", "o", "gate", "up", "down")
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=ALL)


def _lora_model(path, lora=LORA, seed=0):
    """A LoRA model over ``path`` with random (nonzero) B, so the adapters change the logits."""
    module = load_stage(path, ONE_RANK, None, 0, lora=lora)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return module


def _logits(module, seqs):
    tokens, batch = pack(seqs)
    with torch.no_grad():
        return module(tokens, batch)


def test_adapters_are_in_the_sharding_contract_split_like_their_base(tiny_models):
    cfg = dataclasses.replace(ModelConfig.from_pretrained(tiny_models["llama"]), lora=LORA)
    specs = {s.name: s for s in param_specs(cfg)}
    r, h, inter = 4, cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_kv_heads * cfg.head_dim
    q_a, q_b = specs["layers.0.attn.q.lora_A.weight"], specs["layers.0.attn.q.lora_B.weight"]
    assert (q_a.shape, q_a.split_dim, q_b.shape, q_b.split_dim, q_b.unit) == ((r, h), None, (h, r), 0, cfg.head_dim)
    k_b = specs["layers.1.attn.k.lora_B.weight"]
    assert (k_b.shape, k_b.split_dim) == ((kv, r), 0)
    o_a, o_b = specs["layers.0.attn.o.lora_A.weight"], specs["layers.0.attn.o.lora_B.weight"]
    assert (o_a.shape, o_a.split_dim, o_a.unit, o_b.shape, o_b.split_dim) == ((r, h), 1, cfg.head_dim, (h, r), None)
    down_a = specs["layers.3.mlp.down.lora_A.weight"]
    assert (down_a.shape, down_a.split_dim) == ((r, inter), 1)
    adapters = [n for n in specs if is_adapter(cfg, n)]
    assert len(adapters) == 2 * len(ALL) * cfg.num_layers
    # tp=2: the rank's B of q holds its half of the heads, its A of o its half of the attention inputs.
    shard = {s.param.name: s for s in shard_specs(cfg, Strategy(tp=2), 0, 1)}
    assert shard["layers.0.attn.q.lora_B.weight"].shape == (h // 2, r)
    assert shard["layers.0.attn.q.lora_A.weight"].shape == (r, h)
    assert shard["layers.0.attn.o.lora_A.weight"].shape == (r, h // 2)
    assert shard["layers.0.attn.o.lora_B.weight"].shape == (h, r)


def test_fresh_adapters_leave_the_base_model_unchanged_and_only_they_train(tiny_models):
    seqs = sample_sequences([7, 12], seed=4)
    base = load_stage(tiny_models["llama"], ONE_RANK, None, 0)
    lora = load_stage(tiny_models["llama"], ONE_RANK, None, 0, lora=LORA)
    assert torch.equal(_logits(base, seqs), _logits(lora, seqs))  # B = 0
    trained = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in lora.named_parameters() if ".lora_" in n}
    a = lora.get_parameter("layers.0.attn.q.lora_A.weight")
    top = float(a.detach().abs().max())
    assert 0.5 / math.sqrt(a.shape[1]) < top <= 1 / math.sqrt(a.shape[1])
    again = load_stage(tiny_models["llama"], ONE_RANK, None, 0, lora=LORA)
    assert torch.equal(a, again.get_parameter("layers.0.attn.q.lora_A.weight"))  # seeded by name


def test_merged_checkpoint_loads_in_transformers_with_the_lora_models_logits(tiny_models, tmp_path):
    from restage.models.tiny import load_hf

    seqs = sample_sequences([9, 5, 14], seed=5)
    module = _lora_model(tiny_models["llama"])
    ours = _logits(module, seqs)
    base_logits = _logits(load_stage(tiny_models["llama"], ONE_RANK, None, 0), seqs)
    assert float((ours - base_logits).abs().max()) > 1e-2  # the adapters matter
    save_adapters(module, tmp_path / "adapter", tiny_models["llama"])
    merge_lora(tmp_path / "adapter", tiny_models["llama"], tmp_path / "merged")
    hf = load_hf(tmp_path / "merged")
    with torch.no_grad():
        theirs = torch.cat([hf(torch.tensor([s])).logits[0] for s in seqs])
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())
    with pytest.raises(CheckpointError, match="not empty"):
        merge_lora(tmp_path / "adapter", tiny_models["llama"], tmp_path / "merged")


def test_saved_adapters_load_with_peft_and_give_restages_logits(tiny_models, tmp_path):
    import json

    from peft import PeftModel

    from restage.models.tiny import load_hf

    lora = LoraConfig(rank=3, alpha=5.0, target_modules=("q", "v", "down"))
    seqs = sample_sequences([6, 11], seed=6)
    module = _lora_model(tiny_models["qwen2"], lora, seed=1)
    save_adapters(module, tmp_path / "adapter", tiny_models["qwen2"])
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 3, 5.0)
    assert config["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    model = PeftModel.from_pretrained(load_hf(tiny_models["qwen2"]), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = torch.cat([model(torch.tensor([s])).logits[0] for s in seqs])
    ours = _logits(module, seqs)
    assert torch.allclose(theirs, ours, atol=1e-5, rtol=0), float((theirs - ours).abs().max())


def test_merge_lora_command_refuses_a_non_empty_output_in_one_line(tiny_models, tmp_path, capsys):
    from restage.cli import main

    save_adapters(_lora_model(tiny_models["llama"]), tmp_path / "adapter", tiny_models["llama"])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert main(["merge-lora", str(tmp_path / "adapter"), tiny_models["llama"], str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not empty" in err
    assert main(["merge-lora", str(tmp_path / "adapter"), tiny_models["llama"], str(tmp_path / "new")]) == 0
    assert (tmp_path / "new" / "model.safetensors").is_file() and (tmp_path / "new" / "config.json").is_file()


def _config(lora, trainable=True):
    return config_from_dict({"experiment": "x", "algorithm": "grpo",
                             "models": {"actor": {"path": "p", "trainable": trainable, "lora": lora}}})


@pytest.mark.parametrize("lora, key", [
    ({"rank": 0}, "models.actor.lora.rank"),
    ({"alpha": 0}, "models.actor.lora.alpha"),
    ({"target_modules": ["q", "qkv"]}, "models.actor.lora.target_modules"),
    ({"target_modules": []}, "models.actor.lora.target_modules"),
    ({"dropout": 0.1}, "models.actor.lora.dropout"),
    ({"ranks": 4}, "models.actor.lora.ranks"),
])
def test_bad_lora_values_are_one_line_config_errors_naming_the_key(lora, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        _config(lora)
    assert "\n" not in str(err.value)


def test_lora_on_a_frozen_model_is_refused_and_hf_names_map_to_canonical_ones():
    with pytest.raises(ConfigError, match=r"models\.actor\.lora: .*not trainable"):
        _config({"rank": 4}, trainable=False)
    spec = _config({"rank": 4, "target_modules": ["down_proj", "q_proj", "v"]}).models["actor"].lora
    assert spec is not None and spec.canonical_targets() == ("q", "v", "down")


def test_lora_on_gpt2_is_refused_in_one_line(tiny_models):
    from restage.config.sections import LoraSpec
    from restage.plan.problem import with_lora

    with pytest.raises(ConfigError, match=r"models\.actor\.lora: LoRA supports the LLaMA family"):
        with_lora("actor", ModelConfig.from_pretrained(tiny_models["gpt2"]), LoraSpec())
