"""Mixture-of-experts models on one process: the load-balancing loss and its gradients against transformers, router
statistics, the presets' parameter counts, pipeline balance over dense and sparse layers, and one-line errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from restage.errors import CheckpointError, LayoutError
from restage.layout import Layout, Strategy
from restage.models.arch import ModelConfig
from restage.models.flops import block_shape
from restage.models.hf_adapter import hf_config_dict
from restage.models.hf_checkpoint import load_stage
from restage.models.moe import RouterLog
from restage.models.packing import pack
from restage.models.presets import preset
from restage.models.sharding import param_specs, stage_layers, validate_strategy

SEQ = [5, 6, 7, 8, 9, 10, 11, 40, 41, 42, 43, 200, 17]


def _load(path):
    return load_stage(path, Layout((0,), Strategy()), None, 0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_one_sparse_layer_loss_and_gradients_equal_transformers(tmp_path, family):
    # With one sparse layer our per-layer load-balancing loss is transformers' pooled one; the total loss
    # (cross-entropy + coefficient * aux) and every gradient must then agree.
    from restage.models.tiny import build_tiny, load_hf

    path = build_tiny(tmp_path / family, family=family, num_layers=1, mlp_only_layers=[], tokenizer=False)
    hf, ours = load_hf(path), _load(path)
    tokens, batch = pack([SEQ])
    log = RouterLog(ours.cfg)
    logits = ours(tokens, batch, routing=log)
    aux = log.take_aux_loss()
    assert aux is not None and log.take_aux_loss() is None  # taken once
    out = hf(torch.tensor([SEQ]), labels=torch.tensor([SEQ]), output_router_logits=True)
    assert torch.allclose(aux / ours.cfg.router_aux_loss_coef, out.aux_loss, rtol=1e-6)
    loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:]) + aux
    assert torch.allclose(loss, out.loss, rtol=1e-6)
    loss.backward()
    out.loss.backward()
    layer, mlp = hf.model.layers[0], ours.layers["0"].mlp
    width = ours.cfg.moe_intermediate_size
    pairs = [(mlp.router.weight.grad, layer.mlp.gate.weight.grad)]
    for e in range(ours.cfg.num_experts):
        gate_up = layer.mlp.experts.gate_up_proj.grad[e]
        expert = mlp.experts[str(e)]
        pairs += [(expert.gate.weight.grad, gate_up[:width]), (expert.up.weight.grad, gate_up[width:]),
                  (expert.down.weight.grad, layer.mlp.experts.down_proj.grad[e])]
    for mine, theirs in pairs:
        assert (mine - theirs).abs().max() <= 1e-6 * max(1.0, theirs.abs().max().item())


def test_router_stats_report_each_layers_load_in_multiples_of_the_even_share():
    cfg = ModelConfig(family="llama", model_type="mixtral", vocab_size=8, hidden_size=4, intermediate_size=4,
                      num_layers=2, num_heads=1, num_kv_heads=1, max_positions=8, num_experts=4, experts_per_token=2,
                      moe_intermediate_size=4, router_aux_loss_coef=0.5, sparse_layers=(0, 1))
    log = RouterLog(cfg)
    probs = torch.full((4, 4), 0.25)
    # Layer 0: 8 assignments, expert 0 takes 4 (2x the even share of 2), expert 3 none.
    log.record(0, probs, torch.tensor([[0, 1], [0, 2], [0, 1], [0, 2]]))
    log.record(1, probs, torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]))  # balanced
    weighted = log.take_aux_loss()
    stats = log.stats()
    assert stats["router/layer0/max_load"] == 2.0 and stats["router/layer0/min_load"] == 0.0
    assert stats["router/layer1/max_load"] == 1.0 and stats["router/layer1/min_load"] == 1.0
    # Uniform probabilities: E * sum_e f_e * P_e = 4 * (2 * 0.25) = 2 per layer, averaged over the 2 layers.
    assert stats["router/aux_loss"] == pytest.approx(2.0)
    assert weighted.item() == pytest.approx(0.5 * 2.0)


def test_presets_have_the_published_total_and_active_parameter_counts():
    # Mixtral-8x7B: 46.7B parameters, 12.9B per token; Qwen3-30B-A3B: 30.5B, 3.3B (their model cards).
    for name, total, active in (("mixtral-8x7b", 46.70e9, 12.88e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9)):
        cfg = preset(name)
        params = sum(s.numel for s in param_specs(cfg))
        per_token = cfg.num_layers * block_shape(cfg).matmul_params + 2 * cfg.vocab_size * cfg.hidden_size
        assert params == pytest.approx(total, rel=2e-3), name
        assert per_token == pytest.approx(active, rel=2e-3), name
        assert block_shape(cfg).weight_params > block_shape(cfg).matmul_params


def test_pipeline_stages_balance_dense_and_sparse_layers_by_their_own_sizes():
    # Layer 0 is a large mixture, layers 1-5 dense: with pp=2 the mixture gets a stage (almost) to itself.
    cfg = ModelConfig(family="llama", model_type="qwen3_moe", vocab_size=16, hidden_size=32, intermediate_size=32,
                      num_layers=6, num_heads=2, num_kv_heads=2, max_positions=16, num_experts=16, experts_per_token=2,
                      moe_intermediate_size=32, sparse_layers=(0,))
    assert stage_layers(cfg, 2) == ((0, 1), (1, 6))
    names = {s.name for s in param_specs(cfg)}
    assert "layers.0.mlp.experts.15.down.weight" in names and "layers.0.mlp.router.weight" in names
    assert "layers.1.mlp.gate.weight" in names and "layers.0.mlp.gate.weight" not in names


def test_hf_config_round_trip_keeps_the_mixture(tiny_models):
    for name in ("mixtral", "qwen3_moe"):
        cfg = ModelConfig.from_pretrained(tiny_models[name])
        assert cfg.is_moe
        assert ModelConfig.from_hf_dict(hf_config_dict(cfg, torch.float32)) == cfg
    qwen = ModelConfig.from_pretrained(tiny_models["qwen3_moe"])
    assert qwen.sparse_layers == (0, 2, 3) and not qwen.norm_topk_prob


def _edit(tiny_models, tmp_path, name, **changes):
    target = tmp_path / name
    shutil.copytree(tiny_models[name], target)
    config = json.loads((target / "config.json").read_text())
    config.update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(("name", "changes", "message"), [
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and num_experts=4; fix config.json"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1 is not supported; set it to 0 in config.json"),
    ("qwen3_moe", {"mlp_only_layers": [7]}, "mlp_only_layers names layers [7] outside 0..3; fix config.json"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive integer"),
    ("mixtral", {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
     "Qwen2-MoE's shared experts are not supported yet; use a Mixtral or Qwen3-MoE checkpoint"),
])
def test_bad_mixture_configs_get_one_line_saying_what_to_change(tiny_models, tmp_path, name, changes, message):
    with pytest.raises(CheckpointError) as err:
        _load(_edit(tiny_models, tmp_path, name, **changes))
    assert "\n" not in str(err.value) and message in str(err.value)


def test_tp_wider_than_the_experts_is_refused_in_one_line():
    cfg = ModelConfig(family="llama", model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=8, num_kv_heads=8, max_positions=8, num_experts=2, experts_per_token=1,
                      moe_intermediate_size=4, sparse_layers=(0,))
    with pytest.raises(LayoutError, match="tp=8 exceeds the experts' MLP width 4; use tp <= 4"):
        validate_strategy(cfg, Strategy(tp=8))


def test_experiment_config_overrides_the_checkpoints_aux_loss_coefficient(tmp_path):
    from restage.config.load import load_config
    from restage.errors import ConfigError

    job = tmp_path / "job.yaml"
    job.write_text("experiment: x\nalgorithm: sft\nmodels:\n  actor: {path: a, trainable: true}\n")
    assert load_config(job, []).models["actor"].router_aux_loss_coef is None  # config.json's value
    assert load_config(job, ["models.actor.router_aux_loss_coef=0.5"]).models["actor"].router_aux_loss_coef == 0.5
    with pytest.raises(ConfigError, match=r"models.actor.router_aux_loss_coef: -1.0 must be >= 0 \(or left out"):
        load_config(job, ["models.actor.router_aux_loss_coef=-1"])
    cfg = preset("mixtral-8x7b")
    assert RouterLog(cfg).aux_coef == 0.02 and RouterLog(cfg, 0.5).aux_coef == 0.5


def test_lora_on_a_mixtures_mlp_is_refused_in_one_line_and_attention_lora_is_taken():
    from restage.config.sections import LoraSpec
    from restage.errors import ConfigError
    from restage.plan.problem import with_lora

    cfg = preset("qwen3-30b-a3b")
    with pytest.raises(ConfigError) as err:
        with_lora("actor", cfg, LoraSpec(target_modules=("q", "gate_proj")))
    assert str(err.value) == ("models.actor.lora: a mixture of experts takes no adapters on its MLP (gate) yet; "
                              "target attention only (q, k, v, o)")
    adapted = with_lora("actor", cfg, LoraSpec(target_modules=("q", "v")))
    names = {s.name for s in param_specs(adapted)}
    assert "layers.0.attn.q.lora_A.weight" in names and not any("experts" in n and "lora" in n for n in names)
