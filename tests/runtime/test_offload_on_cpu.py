"""Freeing a copy made for an MFC, and offloading a frozen model to host memory and back."""

from __future__ import annotations

import pytest
import torch
from realloc_cases import module_from_state, reference_state, tiny

from restage.runtime.store.offload import ModelCopy


def _model():
    module = module_from_state(reference_state(tiny(), seed=3))
    module.register_buffer("rope", torch.arange(8.0))
    return module


def _values(module):
    return {k: t.detach().clone() for k, t in {**dict(module.named_parameters()), **dict(module.named_buffers())}.items()}


def test_offload_and_reload_keep_the_values_and_the_module_sees_them():
    module = _model()
    before = _values(module)
    param = module.get_submodule("layers.0.attn.q").weight
    nbytes = sum(t.numel() * t.element_size() for t in before.values())
    copy = ModelCopy("ref", module, trainable=False)
    assert copy.device_bytes() == nbytes
    pointer = param.data_ptr()
    assert copy.offload() == nbytes and copy.location == "host" and copy.device_bytes() == 0
    assert param.data_ptr() != pointer  # the storage really moved (CPU to CPU here, device to pinned host on CUDA)
    assert module.get_submodule("layers.0.attn.q").weight is param
    assert copy.reload(torch.device("cpu")) == nbytes and copy.location == "device"
    assert all(torch.equal(t, before[k]) for k, t in _values(module).items())
    # A frozen model does not change, so the host copy is still current: offloading again moves nothing.
    assert copy.offload() == 0 and copy.location == "host"
    assert all(torch.equal(t, before[k]) for k, t in _values(module).items())
    assert copy.reload(torch.device("cpu")) == nbytes


def test_a_copy_made_for_an_mfc_is_freed_and_can_be_filled_again():
    module = _model()
    copy = ModelCopy("actor@gen", module, trainable=False)
    nbytes = copy.device_bytes()
    assert copy.free() == nbytes and copy.device_bytes() == 0 and copy.location == "freed"
    assert all(p.numel() == 0 for p in module.parameters())
    tensors = copy.materialize(torch.device("cpu"))
    assert copy.device_bytes() == nbytes
    assert tensors["layers.1.mlp.up.weight"].shape == (100, 48)


def test_the_trained_copy_is_never_freed_or_offloaded():
    copy = ModelCopy("actor", _model(), trainable=True)
    with pytest.raises(ValueError, match="the trained copy is never freed"):
        copy.free()
    with pytest.raises(ValueError, match="DeepSpeed's to offload"):
        copy.offload()
    assert copy.location == "device" and copy.device_bytes() > 0
