"""Small models, reference shards and the layout pairs the reallocation tests walk through."""

from __future__ import annotations

import torch

from restage.layout import Layout, Strategy
from restage.models.arch import ModelConfig
from restage.models.sharding import param_specs, shard_specs


def tiny(kind: str = "llama") -> ModelConfig:
    """12 heads and 12 KV heads (tp 1, 2, 3, 4, 6 all fit), uneven vocabulary and MLP width, 4 layers."""
    base = dict(family="llama", model_type="llama", vocab_size=203, hidden_size=48, intermediate_size=100,
                num_layers=4, num_heads=12, num_kv_heads=12, max_positions=64)
    extra = {
        "llama": {},
        "tied": dict(tied_embeddings=True),
        "qwen2": dict(model_type="qwen2", qkv_bias=True, num_kv_heads=6, intermediate_size=101),
        "critic": dict(is_critic=True),
        "qwen3": dict(model_type="qwen3", qk_norm=True, head_dim=8, num_kv_heads=6),  # q wider than hidden
        "gpt2": dict(family="gpt2", model_type="gpt2", qkv_bias=True, o_bias=True, tied_embeddings=True,
                     intermediate_size=192),
    }[kind]
    return ModelConfig(**{**base, **extra})


def reference_state(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A full model of random values, the same on every process."""
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen).to(dtype) for s in param_specs(cfg)}


def shard_of(cfg: ModelConfig, layout: Layout, rank: int, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The shard ``rank`` holds in ``layout``, sliced from the full model (empty if not in the mesh)."""
    coord = layout.coord(rank)
    if coord is None:
        return {}
    return {s.param.name: full[s.param.name][s.index()].clone()
            for s in shard_specs(cfg, layout.strategy, coord.pp, coord.tp)}


def L(mesh, dp: int = 1, tp: int = 1, pp: int = 1) -> Layout:  # noqa: N802 - short on purpose: a table of cases
    if isinstance(mesh, range):
        mesh = tuple(mesh)
    return Layout(tuple(mesh), Strategy(dp=dp, tp=tp, pp=pp))


# (model kind, source, destination, what it covers); every pair is also run backwards.
PAIRS_8 = [
    ("llama", L(range(0, 2), tp=2), L(range(0, 3), tp=3), "tp 2->3 overlapping"),
    ("llama", L(range(0, 4), tp=4), L(range(0, 3), tp=3), "tp 4->3 nested"),
    ("llama", L(range(0, 4), tp=4), L(range(4, 7), tp=3), "tp 4->3 disjoint"),
    ("llama", L(range(0, 6), tp=6), L(range(2, 6), tp=4), "tp 6->4 nested"),
    ("llama", L(range(0, 8), dp=2, tp=4), L(range(0, 8), dp=4, tp=2), "tp down dp up, same mesh"),
    ("llama", L(range(0, 8), dp=8), L(range(0, 8), dp=2, tp=4), "tp up from pure dp"),
    ("llama", L(range(0, 4), pp=4), L(range(0, 2), pp=2), "pp 4->2 nested"),
    ("llama", L(range(0, 2), pp=2), L(range(2, 6), pp=4), "pp 2->4 disjoint"),
    ("llama", L(range(0, 8), dp=2, tp=2, pp=2), L(range(0, 8), tp=2, pp=4), "pp up dp down"),
    ("llama", L(range(0, 4), tp=2, pp=2), L(range(0, 8), dp=2, tp=2, pp=2), "dp up, nested"),
    ("llama", L(range(0, 2), dp=2), L(range(0, 8), dp=8), "dp 2->8 nested"),
    ("llama", L(range(0, 8), dp=8), L((3,)), "dp 8 -> one rank"),
    ("llama", L(range(0, 4), dp=4), L(range(4, 8), dp=2, tp=2), "dp 4 -> dp2tp2 disjoint"),
    ("llama", L(range(0, 4), dp=2, tp=2), L(range(1, 5), dp=2, tp=2), "shifted by one"),
    ("llama", L(range(0, 4), tp=4), L(range(2, 6), tp=4), "shifted by two"),
    ("llama", L(range(0, 6), dp=3, tp=2), L(range(2, 8), dp=3, tp=2), "shifted dp3tp2"),
    ("llama", L((7, 5, 3, 1), tp=4), L((0, 2, 4, 6), dp=2, tp=2), "interleaved disjoint meshes"),
    ("llama", L((0, 1, 2, 3), dp=2, pp=2), L((3, 2, 1, 0), tp=2, pp=2), "reversed mesh"),
    ("llama", L(range(0, 4), dp=2, tp=2), L(range(0, 4), dp=2, tp=2), "equal layouts"),
    ("llama", L(range(0, 8), dp=2, tp=2, pp=2), L(range(0, 8), dp=2, tp=4), "pp down tp up"),
    ("llama", L(range(0, 6), tp=3, pp=2), L(range(0, 8), dp=2, tp=2, pp=2), "tp 3->2 with pp, overlapping"),
    ("llama", L(range(0, 8), tp=4, pp=2), L(range(2, 8), tp=6), "tp 4->6 pp 2->1"),
    ("llama", L((5,)), L(range(0, 8), tp=4, pp=2), "one rank -> tp4pp2"),
    ("llama", L((6, 7), tp=2), L(range(0, 6), dp=2, tp=3), "tp 2->3 dp up disjoint"),
    ("tied", L(range(0, 4), pp=4), L(range(0, 4), dp=2, pp=2), "tied embeddings, pp 4->2"),
    ("tied", L(range(0, 2), tp=2), L(range(2, 8), tp=2, pp=3), "tied embeddings, pp 1->3 disjoint"),
    ("tied", L(range(0, 8), dp=2, tp=2, pp=2), L((0,)), "tied embeddings, to one rank"),
    ("qwen2", L(range(0, 3), tp=3), L(range(3, 7), dp=2, tp=2), "qkv bias, 6 KV heads, tp 3->2"),
    ("qwen2", L(range(0, 6), dp=1, tp=6), L(range(1, 7), tp=3, pp=2), "qkv bias, tp 6->3 pp up, shifted"),
    ("critic", L(range(0, 4), dp=2, pp=2), L(range(4, 8), tp=2, pp=2), "critic head, disjoint"),
    ("qwen3", L(range(0, 6), tp=6), L(range(2, 8), dp=2, tp=3), "qwen3 q/k norms, head_dim 8, tp 6->3"),
    ("gpt2", L(range(0, 4), tp=4), L(range(0, 6), dp=2, tp=3), "gpt2 biases and positions, tp 4->3"),
    ("gpt2", L(range(0, 8), dp=4, pp=2), L(range(3, 7), tp=2, pp=2), "gpt2 tied, pp and tp change"),
]

# Uneven nodes (3 ranks per node) to exercise the sender choice without any fixed node size.
def node_of_3(rank: int) -> int:
    return rank // 3


def module_from_state(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain module whose ``named_parameters()`` are exactly ``state`` under its canonical names."""
    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor.clone()))
    return root
