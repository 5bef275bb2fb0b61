"""Bad input gets one line that names what to change (library calls and ``restage generate``)."""

from __future__ import annotations

import json
import shutil

import pytest

from restage.cli import main as restage
from restage.errors import CheckpointError, LayoutError, RestageError
from restage.layout import Layout, Strategy
from restage.models.hf_checkpoint import load_stage


def _load(path, tp=1, pp=1):
    return load_stage(path, Layout(tuple(range(tp * pp)), Strategy(tp=tp, pp=pp)), None, 0)


def _copy(tiny_models, tmp_path, name="llama"):
    target = tmp_path / name
    shutil.copytree(tiny_models[name], target)
    return target


def _one_line(err: RestageError) -> str:
    text = str(err)
    assert "\n" not in text
    return text


def test_missing_directory_and_missing_config(tmp_path):
    with pytest.raises(CheckpointError) as err:
        _load(tmp_path / "nowhere")
    assert "does not exist; point the model's path at a HF model directory" in _one_line(err.value)
    with pytest.raises(CheckpointError) as err:
        _load(tmp_path)
    assert "has no config.json" in _one_line(err.value)


def test_malformed_config_and_weights(tiny_models, tmp_path):
    model = _copy(tiny_models, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json is not valid JSON .*; fix or replace it"):
        _load(model)
    (model / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(CheckpointError, match="has shape .* config.json implies .*; the weights do not match the config"):
        _load(model)
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read .*; re-download or re-save it"):
        _load(model)
    (model / "model.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        _load(model)
    assert "has no model.safetensors, model.safetensors.index.json or pytorch_model.bin" in _one_line(err.value)


def test_unsupported_architecture_lists_the_supported_ones(tiny_models, tmp_path):
    model = _copy(tiny_models, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(CheckpointError) as err:
        _load(model)
    message = _one_line(err.value)
    assert "architecture 'BertForMaskedLM' is not supported; use one of:" in message
    assert all(arch in message for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"))


def test_layouts_the_model_cannot_take(tiny_models):
    # The tiny llama has 4 heads, 2 KV heads and 4 layers.
    with pytest.raises(LayoutError) as err:
        _load(tiny_models["llama"], tp=4)
    assert "tp=4 does not divide 4 attention heads and 2 KV heads; use tp in [1, 2]" in _one_line(err.value)
    with pytest.raises(LayoutError) as err:
        _load(tiny_models["llama"], pp=5)
    assert "pp=5 is larger than its 4 layers; use pp <= 4" in _one_line(err.value)


@pytest.mark.parametrize("argv,expected", [
    (["{nowhere}", "--token-ids", "1 2"], "does not exist"),
    (["{llama}", "--tp", "3", "--token-ids", "1 2"], "tp=3 does not divide 4 attention heads"),
    (["{llama}", "--pp", "8", "--token-ids", "1 2"], "pp=8 is larger than its 4 layers"),
    (["{llama}", "--tp", "2", "-n", "3", "--token-ids", "1 2"], "-n 3 is not a multiple of tp*pp = 2"),
    (["{llama}"], "no prompts; pass --prompt TEXT"),
    (["{llama}", "--token-ids", "1 x"], "is not a list of integers"),
])
def test_restage_generate_prints_one_line_and_exits_2(tiny_models, tmp_path, capsys, argv, expected):
    argv = [a.format(nowhere=tmp_path / "nowhere", llama=tiny_models["llama"]) for a in argv]
    assert restage(["generate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("restage: error: ") and expected in err


@pytest.mark.parametrize("change,expected", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}},
     "rope type 'longrope' is not supported; use one of default, linear, dynamic, llama3, yarn"),
    ({"model_type": "llama5"}, "model_type 'llama5' does not match architecture 'LlamaForCausalLM'; set model_type to "
                               "'llama'"),
])
def test_unsupported_rope_or_model_type_in_restage_generate_is_one_line(tiny_models, tmp_path, capsys, change, expected):
    model = _copy(tiny_models, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    assert restage(["generate", str(model), "--token-ids", "1 2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("restage: error: ") and expected in err
