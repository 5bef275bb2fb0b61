"""The model store's bookkeeping: which copies are current, freeing them, and a frozen shard offloaded and back."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from realloc_cases import L, module_from_state, reference_state, tiny

from restage.graph import DataflowGraph
from restage.runtime.store.model_store import ModelSlot, ModelStore

HOME, OTHER = L((0,)), L((1, 2), dp=2)  # rank 0 holds the home shard, not the copy


def _store(**trainable: bool) -> ModelStore:
    store = ModelStore(SimpleNamespace(models={}), SimpleNamespace(models={}), DataflowGraph(()), rank=0,
                       device=torch.device("cpu"), node_of=lambda rank: 0)
    for name, is_trained in trainable.items():
        entry = SimpleNamespace(trainable=is_trained, dtype="fp32", home_layout=HOME)  # what the store reads of one
        store.slots[name] = ModelSlot(name, entry, tiny())
    return store


def test_a_frozen_models_copy_is_made_once_until_freed():
    store = _store(ref=False)
    assert not store.copy_current("ref", OTHER)
    store.adopt_copy("ref", OTHER, {}, groups=None)  # rank 0 sends only: it keeps no module
    assert store.copy_current("ref", OTHER) and store.frozen_copies == {("ref", OTHER)}
    assert store.slots["ref"].copies == {}
    store.free("ref", OTHER)
    assert not store.copy_current("ref", OTHER) and store.frozen_copies == set()


def test_trained_and_ema_updated_models_copies_are_made_again():
    store = _store(actor=True, ref=False)
    store.ema = {"ref": "actor_train"}  # an EMA moves the reference: its copies go stale
    for name in ("actor", "ref"):
        store.adopt_copy(name, OTHER, {}, groups=None)
        assert not store.frozen(name) and not store.copy_current(name, OTHER)
    assert store.frozen_copies == set()


def test_offload_and_reload_move_the_home_shard_and_keep_one_host_copy():
    store = _store(ref=False, reward=False)
    slot = store.slots["ref"]
    slot.module = module_from_state(reference_state(tiny(), seed=3))
    before = {k: t.detach().clone() for k, t in slot.module.state_dict().items()}
    store.offload("ref")
    host = slot.host_copy
    assert host is not None and host.location == "host"
    store.reload("ref")
    assert slot.host_copy is host and host.location == "device"
    assert all(torch.equal(t, before[k]) for k, t in slot.module.state_dict().items())
    store.offload("reward")  # this rank holds no reward shard: nothing to move
    assert store.slots["reward"].host_copy is None
