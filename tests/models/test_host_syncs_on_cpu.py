"""No host sync inside a forward: attention reads lengths the host already knows, never the device's.

On a GPU, ``.tolist()``, ``.item()``, ``int(t)``, a boolean-mask index or ``repeat_interleave``
without ``output_size`` make the host wait for the device. Here every input that would live on
the device is a ``DeviceOnly`` tensor, and anything computed from one is too; each of those
calls on one raises. The outputs must equal a plain run's.
"""

from __future__ import annotations

import pytest
import torch
from model_cases import PROMPTS

from restage.layout import Layout, Strategy
from restage.models.attention import Decode, Prefill
from restage.models.packing import PackedBatch, pack


class HostSync(AssertionError):
    pass


_SYNCS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
          torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.masked_select, torch.Tensor.masked_select,
          torch.unique, torch.Tensor.cpu, torch.Tensor.numpy}


class DeviceOnly(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS:
            raise HostSync(f"{getattr(func, '__name__', func)} on a device tensor")
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and "output_size" not in kwargs:
            raise HostSync("repeat_interleave without output_size")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise HostSync("boolean-mask index")
        return super().__torch_function__(func, types, args, kwargs)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(DeviceOnly)


def device_batch(batch: PackedBatch) -> PackedBatch:
    return PackedBatch(on_device(batch.cu_seqlens), on_device(batch.positions), batch.max_seqlen, batch.seqlens)


def test_the_trap_catches_a_sync():
    with pytest.raises(HostSync, match="tolist"):
        on_device(torch.arange(3)).add(1).tolist()


@pytest.mark.parametrize("name", ["llama", "mistral"])  # mistral: the sliding-window masks
@pytest.mark.parametrize("prompts", [PROMPTS, [PROMPTS[1], PROMPTS[3]]], ids=["mixed", "equal"])  # padded / by length
def test_prefill_and_decode_never_sync(tiny_models, name, prompts):
    from restage.models.hf_checkpoint import load_stage

    module = load_stage(tiny_models[name], Layout((0,), Strategy()), None, 0)
    tokens, batch = pack(prompts)
    steps = 3
    outputs = {}
    for kind, wrap, wrap_batch in (("plain", lambda t: t, lambda b: b), ("device", on_device, device_batch)):
        with torch.no_grad():
            full = module(wrap(tokens), wrap_batch(batch))  # no cache: training / inference
            cache = module.new_cache(len(prompts), batch.max_seqlen + steps)
            lengths, longest = wrap(torch.zeros(len(prompts), dtype=torch.int64)), 0
            step_batch, inputs, select, logits = wrap_batch(batch), wrap(tokens), batch.last_token_index(), []
            for step in range(steps):
                attn = Decode(lengths, longest) if step > 0 else Prefill()
                out = module(inputs, step_batch, cache=cache, select=wrap(select) if select is not None else None,
                             attn=attn)
                lengths = lengths + (step_batch.cu_seqlens[1:] - step_batch.cu_seqlens[:-1]).to(lengths)
                longest += max(step_batch.seqlens)
                logits.append(out)
                inputs = out.argmax(-1)
                step_batch, select = PackedBatch.decode_step(lengths.clone()), None
        outputs[kind] = (full, logits)
    torch.testing.assert_close(outputs["device"][0].as_subclass(torch.Tensor), outputs["plain"][0], rtol=0, atol=0)
    for got, want in zip(outputs["device"][1], outputs["plain"][1]):
        torch.testing.assert_close(got.as_subclass(torch.Tensor), want, rtol=0, atol=0)
