"""A checkpoint's LoRA export is checked on resume against the SHA-256 recorded at save (or, in an older
checkpoint, that it opens): a corrupted, truncated or removed export is named with why."""

import torch
from safetensors.torch import save_file

from restage.runtime.checkpoint.export_check import EXPORTS_KEY, bad_exports, export_digests, export_path


def _export(checkpoint, model, value):
    path = checkpoint / export_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.x.lora_A.weight": torch.full((2, 3), value)}, str(path), metadata={"format": "pt"})
    return path


def test_exports_are_checked_against_the_digest_recorded_at_save(tmp_path):
    actor, critic = _export(tmp_path, "actor", 1.0), _export(tmp_path, "critic", 2.0)
    manifest = {EXPORTS_KEY: export_digests(tmp_path, ["actor", "critic"])}
    assert bad_exports(tmp_path, ["actor", "critic"], manifest) == {}
    data = actor.read_bytes()
    actor.write_bytes(data[:-4] + b"\0\0\0\1")  # one value's bytes: still a readable file
    critic.unlink()
    assert bad_exports(tmp_path, ["actor", "critic"], manifest) == {
        "actor/adapter/adapter_model.safetensors": "its SHA-256 differs from the one recorded at save",
        "critic/adapter/adapter_model.safetensors": "missing"}
    actor.write_bytes(data)
    _export(tmp_path, "critic", 2.0)  # the same tensors again: the same bytes
    assert bad_exports(tmp_path, ["actor", "critic"], manifest) == {}


def test_a_checkpoint_from_before_the_record_is_checked_for_a_file_that_opens(tmp_path):
    actor = _export(tmp_path, "actor", 1.0)
    assert bad_exports(tmp_path, ["actor"], {}) == {}
    actor.write_bytes(actor.read_bytes()[:20])
    why = bad_exports(tmp_path, ["actor"], {"step": 2})["actor/adapter/adapter_model.safetensors"]
    assert why.startswith("unreadable (") and "\n" not in why
