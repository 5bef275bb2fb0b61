"""LoRA adapters on disk in PEFT's layout, and merging them into a plain HF checkpoint.

A saved adapter directory is what ``peft.PeftModel.from_pretrained(base, dir)`` loads:
``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``, ``target_modules`` in HF names,
``base_model_name_or_path``: the base's absolute directory) and ``adapter_model.safetensors`` with the HF names PEFT gives them
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; a critic's scalar head as a
module PEFT saves whole, ``base_model.model.score.weight``). ``merge_lora`` writes ``W + (alpha / r) B A``
into a copy of the base checkpoint that ``transformers`` loads with no PEFT at all.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from restage.errors import CheckpointError
from restage.models.arch import LoraConfig, ModelConfig
from restage.models.decoder import StageModule
from restage.models.hf_adapter import hf_source
from restage.models.hf_checkpoint import TOKENIZER_FILES, WeightReader, gather_full
from restage.models.sharding import LORA_TARGETS, is_adapter, shard_specs

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Canonical LoRA target -> the HF module name PEFT targets (LLaMA family).
HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
              "down": "down_proj"}


def peft_key(cfg: ModelConfig, name: str) -> str:
    """The PEFT file's key of a canonical adapter (``layers.0.attn.q.lora_A.weight``) or a critic's head."""
    if name == "score.weight":
        return PEFT_PREFIX + hf_source(cfg, name).key
    module, factor = name.rsplit(".", 2)[0], name.split(".")[-2]  # layers.0.attn.q, lora_A
    base = hf_source(cfg, module + ".weight").key.removesuffix(".weight")
    return f"{PEFT_PREFIX}{base}.{factor}.weight"


def base_reference(path: str | Path) -> str:
    """What ``base_model_name_or_path`` holds: the base's absolute directory, which loads from anywhere (a relative
    one only from where the run started), or a value that is no local path (a hub id) as given."""
    return str(Path(path).resolve()) if str(path) and Path(path).exists() else str(path)


def adapter_config(cfg: ModelConfig, base_model_name_or_path: str | Path) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``cfg.lora`` (the base as ``base_reference`` writes it)."""
    lora = cfg.lora
    assert lora is not None  # callers save LoRA models only
    return {"peft_type": "LORA", "task_type": "SEQ_CLS" if cfg.is_critic else "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": sorted(HF_TARGETS[t] for t in lora.target_modules), "use_rslora": False,
            "modules_to_save": ["score"] if cfg.is_critic else None, "init_lora_weights": True,
            "inference_mode": True, "base_model_name_or_path": base_reference(base_model_name_or_path)}


def save_adapters(module: StageModule, path: str | Path, base_model_name_or_path: str) -> None:
    """Write ``module``'s adapters in PEFT's layout at ``path`` (collective over data-parallel replica 0, as
    ``checkpoint.save_checkpoint``): TP shards are gathered, each pipeline stage writes a part, stage 0 joins them."""
    cfg, ctx = module.cfg, module.ctx
    if ctx.dp_rank != 0:
        return
    path = Path(path)
    shards = {s.param.name: s for s in shard_specs(cfg, ctx.shard_strategy, ctx.pp_stage, ctx.tp_rank,
                                                   ctx.ep_rank)}
    full = {peft_key(cfg, name): gather_full(param.detach(), shards[name], ctx).to("cpu").contiguous()
            for name, param in module.named_parameters() if is_adapter(cfg, name)}
    if ctx.tp_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(full, str(path / f".part-{ctx.pp_stage}.safetensors"), metadata={"format": "pt"})
    if ctx.pp_size > 1:
        dist.barrier(group=ctx.pp_group)  # every stage's part is on disk
    if ctx.tp_rank == 0 and ctx.is_first_stage:
        joined: dict[str, torch.Tensor] = {}
        for stage in range(ctx.pp_size):
            part = path / f".part-{stage}.safetensors"
            with safe_open(str(part), framework="pt") as handle:
                joined.update({key: handle.get_tensor(key) for key in handle.keys()})  # noqa: SIM118  # not a dict
            part.unlink()
        save_file(dict(sorted(joined.items())), str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(cfg, base_model_name_or_path)
        (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    for group, size in ((ctx.pp_group, ctx.pp_size), (ctx.tp_group, ctx.tp_size)):
        if size > 1:  # nobody returns before the adapter file is whole
            dist.barrier(group=group)


def read_adapters(path: str | Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The LoRA settings and the tensors (by PEFT key) of a PEFT adapter directory."""
    path = Path(path)
    config_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file() or not weights.is_file():
        raise CheckpointError(f"{path} has no {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}; point at a saved LoRA adapter "
                              "directory (checkpoints/step-N/<model>/adapter)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
    by_hf = {hf: canonical for canonical, hf in HF_TARGETS.items()}
    targets = config.get("target_modules") or []
    unknown = sorted(set(targets) - set(by_hf))
    if unknown:
        raise CheckpointError(f"{config_file}: target_modules {unknown} are not among {sorted(by_hf)}")
    lora = LoraConfig(int(config["r"]), float(config["lora_alpha"]), tuple(by_hf[t] for t in targets))
    with safe_open(str(weights), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118  # not a dict
    return lora, tensors


def merge_lora(adapter_dir: str | Path, base_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``base_dir``'s checkpoint with ``W + (alpha / r) B A`` into ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not empty; give merge-lora a new or empty output directory")
    lora, tensors = read_adapters(adapter_dir)
    if PEFT_PREFIX + "score.weight" in tensors:
        raise CheckpointError(f"{adapter_dir}: holds a critic's adapters; merge-lora writes causal LMs only")
    cfg = ModelConfig.from_pretrained(base_dir)
    if not cfg.traits.hf.canonical_layout:  # GPT-2 fuses q, k, v and transposes its weights
        raise CheckpointError(f"{base_dir}: LoRA merging supports the LLaMA family (llama, mistral, qwen2), not "
                              f"{cfg.traits.hf_name}")
    reader = WeightReader(base_dir)
    state = {key: reader.read(key) for key in sorted(reader.keys())}
    scaled = lora.scale
    for layer in range(cfg.num_layers):
        for target in lora.target_modules:
            name = f"layers.{layer}.{LORA_TARGETS[target]}"
            a = tensors.get(peft_key(cfg, f"{name}.lora_A.weight"))
            b = tensors.get(peft_key(cfg, f"{name}.lora_B.weight"))
            if a is None or b is None:
                raise CheckpointError(f"{adapter_dir}: no adapter for {name}; was it saved from a model of "
                                      f"{base_dir}'s architecture?")
            key = reader.resolve(hf_source(cfg, f"{name}.weight").key)
            assert key is not None, f"{base_dir}: no tensor for {name}"  # from_pretrained checked the config
            weight = state[key]
            state[key] = (weight.double() + scaled * (b.double() @ a.double())).to(weight.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(Path(base_dir) / "config.json", out / "config.json")
    for name in TOKENIZER_FILES:
        if (Path(base_dir) / name).is_file():
            shutil.copyfile(Path(base_dir) / name, out / name)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``restage merge-lora ADAPTER_DIR BASE_DIR OUT_DIR``."""
    parser.add_argument("adapter_dir", help="saved adapters (checkpoints/step-N/<model>/adapter, PEFT layout)")
    parser.add_argument("base_dir", help="the HF model directory the adapters were trained on")
    parser.add_argument("out_dir", help="where to write the merged HF checkpoint (new or empty)")


def main(args: argparse.Namespace) -> int:
    out = merge_lora(args.adapter_dir, args.base_dir, args.out_dir)
    print(f"restage: merged {args.adapter_dir} into {out}")
    return 0
