"""What a LoRA export stores loads from anywhere (the base's absolute path), and LoRA's default targets are PEFT's
all-linear: the seven linears of a dense block, attention only on a mixture of experts."""

import json
import os
from pathlib import Path

from restage.config.sections import LORA_MODULES, LoraSpec
from restage.layout import Layout, Strategy
from restage.models.arch import LoraConfig
from restage.models.hf_checkpoint import load_stage
from restage.models.lora_checkpoint import adapter_config, save_adapters
from restage.models.presets import preset
from restage.plan.problem import with_lora


def test_the_exported_adapter_config_names_the_base_by_its_absolute_path(tiny_models, tmp_path, monkeypatch):
    base = Path(tiny_models["llama"])
    monkeypatch.chdir(base.parent)  # the run's working directory: the base given relative to it
    module = load_stage(base.name, Layout((0,), Strategy()), None, 0, lora=LoraConfig(2, 4.0, ("q", "v")))
    save_adapters(module, tmp_path / "adapter", base.name)
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(base.resolve()) and os.path.isabs(saved["base_model_name_or_path"])
    assert adapter_config(module.cfg, "Qwen/Qwen3-0.6B")["base_model_name_or_path"] == "Qwen/Qwen3-0.6B"  # a hub id


def test_the_default_targets_are_all_linear_and_attention_only_on_a_mixture():
    assert LoraSpec().target_modules == ("all-linear",) and LoraSpec().canonical_targets() == LORA_MODULES
    dense = with_lora("actor", preset("llama-7b"), LoraSpec())
    assert dense.lora is not None and dense.lora.target_modules == ("q", "k", "v", "o", "gate", "up", "down")
    moe = with_lora("actor", preset("qwen3-30b-a3b"), LoraSpec())
    assert moe.lora is not None and moe.lora.target_modules == ("q", "k", "v", "o")
