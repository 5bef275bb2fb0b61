"""A checkpoint's LoRA exports, verified on resume: the file a user loads must be what the engine state holds.

A resume reads a LoRA model's adapters from ``<model>/engine/``; ``<model>/adapter/adapter_model.safetensors``
(the PEFT export, what ``peft`` and ``restage merge-lora`` load) is not read back, so a corrupted or removed
export would stay in the checkpoint unnoticed. At save the master records each export's SHA-256 in the
manifest (``exports``); at resume it checks the newest checkpoint's exports (against that digest, or, in a
checkpoint from before the record, that the file opens) and the ranks rewrite a bad one from the engine state
they loaded (``runtime/checkpoint/run_state.py``), saying so in one line. ``safetensors`` writes the same tensors to the
same bytes, so a rewritten export equals the one first saved.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from restage.models.lora_checkpoint import ADAPTER_WEIGHTS

EXPORTS_KEY = "exports"  # manifest.json: export path (relative to the checkpoint) -> SHA-256 hex
_CHUNK_BYTES = 1 << 20


def export_path(model: str) -> str:
    return f"{model}/adapter/{ADAPTER_WEIGHTS}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def export_digests(checkpoint: Path, models: Iterable[str]) -> dict[str, str]:
    """The SHA-256 of each model's adapter export under ``checkpoint`` (the manifest's ``exports``)."""
    return {export_path(m): sha256(checkpoint / export_path(m)) for m in models}


def bad_exports(checkpoint: Path, models: Iterable[str], manifest: dict[str, Any]) -> dict[str, str]:
    """Export path -> why it is not what was saved (missing, a different digest, unreadable); {} when all are."""
    recorded = manifest.get(EXPORTS_KEY) or {}
    bad = {}
    for model in models:
        rel = export_path(model)
        path = checkpoint / rel
        if not path.is_file():
            bad[rel] = "missing"
        elif rel in recorded:
            if sha256(path) != recorded[rel]:
                bad[rel] = "its SHA-256 differs from the one recorded at save"
        else:  # a checkpoint from before the record: at least it must open
            try:
                with safe_open(str(path), framework="pt") as handle:
                    list(handle.keys())
            except Exception as err:  # noqa: BLE001  # safetensors raises its own SafetensorError, OSError, ...
                bad[rel] = f"unreadable ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    return bad
