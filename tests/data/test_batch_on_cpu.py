import pytest
import torch

from restage.data.batch import Batch, concat, pack_sequences
from restage.models.packing import contiguous_parts


def make_batch():
    seqs = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12], [13]]
    batch = pack_sequences(seqs, group_size=2, prompt_lens=[1, 1, 1, 2, 1, 1], ids=["a", "b", "c"])
    return batch.with_keys(seqs={"rewards": torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])})


def test_packed_layout_and_cu_seqlens():
    batch = make_batch()
    assert batch.n_seqs == 6 and batch.n_samples == 3 and batch.n_tokens == 13
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6, 10, 12, 13]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch["prompt_mask"].tolist()[:5] == [True, False, False, True, False]
    assert batch.sample_tokens() == [5, 5, 3]


def test_select_keeps_groups_together_and_concat_inverts_split():
    batch = make_batch()
    picked = batch.select([2, 0])
    assert picked.ids == ("c", "a")
    assert picked["seqs"].tolist() == [11, 12, 13, 1, 2, 3, 4, 5]
    assert picked["rewards"].tolist() == [4.0, 5.0, 0.0, 1.0]
    for balance in ("tokens", "samples"):
        parts = batch.split(2, balance=balance)
        assert sum(p.n_samples for p in parts) == 3 and all(p.n_samples for p in parts)
        joined = concat(parts)
        assert joined.seqlens == batch.seqlens and joined.ids == batch.ids
        assert torch.equal(joined["seqs"], batch["seqs"]) and torch.equal(joined["rewards"], batch["rewards"])
    assert len(batch.split(10)) == 3


def test_contiguous_parts_balance_weights():
    assert contiguous_parts([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert contiguous_parts([1, 1, 1, 1], 2) == [[0, 1], [2, 3]]
    assert contiguous_parts([1, 1], 5) == [[0], [1]]


def test_select_seqs_regroups_and_rename():
    batch = make_batch().select_seqs([3, 0], group_size=1).renamed({"seqs": "greedy_seqs"})
    assert batch.seqlens == (4, 3) and batch.group_size == 1
    assert batch["greedy_seqs"].tolist() == [7, 8, 9, 10, 1, 2, 3]
    assert "seqs" not in batch


def test_inconsistent_batches_are_refused():
    with pytest.raises(ValueError, match="per-token key 'x' has 2 rows for 3 tokens"):
        Batch((3,), {"x": torch.zeros(2)})
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        Batch((1, 1, 1), {}, {}, 2)
    with pytest.raises(ValueError, match="at least one token"):
        Batch((0,))
    with pytest.raises(KeyError, match="no key 'nope'"):
        make_batch()["nope"]
    with pytest.raises(ValueError, match="cannot concat"):
        concat([make_batch(), make_batch().only(["seqs"])])
