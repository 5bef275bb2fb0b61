import pytest
import torch

from restage.errors import LayoutError
from restage.layout import Strategy
from restage.models.arch import ModelConfig
from restage.models.sharding import param_specs, shard_specs, split_range, stage_layers, stage_params


def llama(**kw):
    base = dict(family="llama", model_type="llama", vocab_size=1001, hidden_size=48, intermediate_size=130,
                num_layers=5, num_heads=6, num_kv_heads=3, max_positions=64)
    return ModelConfig(**{**base, **kw})


def test_split_range_covers_total_in_units():
    for total, parts, unit in [(1001, 3, 1), (130, 4, 1), (48, 3, 8), (48, 6, 8)]:
        chunks = [split_range(total, parts, i, unit) for i in range(parts)]
        assert chunks[0][0] == 0 and chunks[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert all((hi - lo) % unit == 0 for lo, hi in chunks)
        sizes = [hi - lo for lo, hi in chunks]
        assert max(sizes) - min(sizes) <= unit


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp,pp", [(1, 1), (3, 1), (1, 3), (3, 2)])
def test_shards_tile_every_parameter_exactly(tp, pp, tied):
    cfg = llama(tied_embeddings=tied)
    full = {s.name: torch.zeros(s.shape) for s in param_specs(cfg)}
    for stage in range(pp):
        for t in range(tp):
            for shard in shard_specs(cfg, Strategy(tp=tp, pp=pp), stage, t):
                if shard.param.split_dim is None and t > 0:
                    continue
                if shard.param.name == "embed.weight" and stage > 0:
                    continue  # the tied copy on the last stage
                full[shard.param.name][shard.index()] += 1
    assert all(bool((v == 1).all()) for v in full.values())


def test_stage_layers_are_contiguous_and_balanced():
    cfg = llama(num_layers=8, vocab_size=50)
    ranges = stage_layers(cfg, 4)
    assert ranges == ((0, 2), (2, 4), (4, 6), (6, 8))
    big_vocab = llama(num_layers=8, vocab_size=20000)
    ranges = stage_layers(big_vocab, 2)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8 and ranges[0][1] == ranges[1][0]
    assert ranges[0][1] - ranges[0][0] == ranges[1][1] - ranges[1][0]  # embedding and head weigh the same
    assert [s.name for s in stage_params(llama(tied_embeddings=True), 2, 1)][-1] == "embed.weight"


def test_layouts_the_model_cannot_take_are_refused():
    with pytest.raises(LayoutError, match="tp=4 does not divide 6 attention heads and 3 KV heads; use tp in \\[1, 3\\]"):
        shard_specs(llama(), Strategy(tp=4), 0, 0)
    with pytest.raises(LayoutError, match="pp=6 is larger than its 5 layers"):
        stage_layers(llama(), 6)
