"""Saving and resuming a run: every trainable model, optimizer, scheduler, data cursor, RNG and algorithm state.

Layout of ``checkpoints/step-N/`` (whole or absent, see ``checkpoint_dir``):
``<model>/hf/`` a HF directory (safetensors + config.json + tokenizer) that transformers loads
(trainable models, and a reference that an EMA updates); for a LoRA model instead ``<model>/adapter/``, its
adapters in PEFT's layout over the base at the model's path (``restage merge-lora`` makes a HF directory of it);
``<model>/ema/rank<R>.pt`` the fp32 master of a bf16/fp16 reference an EMA moves (each rank's shard);
``<model>/engine/`` DeepSpeed's own files (module, optimizer and LR scheduler state per rank);
``ranks/rank<R>.pt`` each rank's RNG states and algorithm state; ``manifest.json`` the master's
data cursor and step. A resume needs the same schedule (same layouts and world size).
"""

from __future__ import annotations

import contextlib
import json
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.serialization import MAP_LOCATION

from restage.disk import writing
from restage.errors import CheckpointError
from restage.layout import ProcessGroups
from restage.models.hf_checkpoint import load_stage, save_checkpoint
from restage.models.lora_checkpoint import save_adapters
from restage.models.sharding import is_adapter
from restage.runtime.checkpoint import checkpoint_dir
from restage.runtime.checkpoint.export_check import EXPORTS_KEY, bad_exports, export_digests, export_path, sha256
from restage.runtime.control.channels import Control
from restage.runtime.control.master import Master
from restage.runtime.dataplane.rollout_buffer import RolloutBuffer
from restage.runtime.step.nonfinite import NonFiniteError, any_rank, finite_files, finite_weights
from restage.runtime.store.model_store import ModelSlot, ModelStore
from restage.runtime.store.zero_engines import Engine, barriers_on, engine_groups

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from restage.algorithms.base import AlgoState
    from restage.models.decoder import StageModule

ENGINE_TAG = "state"


def _engine_group(groups: ProcessGroups, slot: ModelSlot, rank: int) -> ProcessGroup | None:
    return groups.get(slot.home.mesh) if slot.home.size > 1 else groups.get((rank,))


def _rank_state(algo_state: AlgoState, buffer: RolloutBuffer | None) -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "algo": algo_state.state_dict()}
    if buffer is not None:  # async mode: the batches generated ahead (runtime/dataplane/rollout_buffer.py)
        state["rollout_buffer"] = buffer.state_dict()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _trained(store: ModelStore) -> list[StageModule]:
    return [slot.module for slot in store.slots.values() if slot.engine is not None and slot.module is not None]


def save(trial_dir: Path, step: int, store: ModelStore, groups: ProcessGroups, control: Control, algo_state: AlgoState,
         master: Master | None, keep_checkpoints: int, buffer: RolloutBuffer | None = None) -> None:
    """Collective over all ranks: write checkpoint ``step`` of ``store``'s models, this rank's RNG and
    ``algo_state`` (and async mode's rollout ``buffer``), and the master's data cursor (``master`` on rank 0, else
    None); seal it."""
    if any_rank(not finite_weights(_trained(store)), dist.group.WORLD, store.device):  # before anything is written
        last = checkpoint_dir.latest(trial_dir)
        raise NonFiniteError(f"step {step}: non-finite weights; not checkpointed (the newest checkpoint, "
                             f"{last.name if last else 'none'}, stays the last)")
    # Every rank writes: a full disk on any of them is one line naming the checkpoint (the earlier ones stay whole).
    with writing(f"checkpoint step-{step}", checkpoint_dir.checkpoints_root(trial_dir)):
        path = Path(control.bcast(str(checkpoint_dir.begin(trial_dir, step)) if control.is_master else None))
        _write_models(path, store, groups)
        ranks = path / "ranks"
        ranks.mkdir(exist_ok=True)
        torch.save(_rank_state(algo_state, buffer), ranks / f"rank{store.rank}.pt")
        control.barrier()
        if master is not None:  # with the exports' digests, which a resume checks (runtime/checkpoint/export_check.py)
            exports = {EXPORTS_KEY: export_digests(path, _lora_models(store))}
            checkpoint_dir.commit(trial_dir, step, {**master.checkpoint_state(), **exports}, keep_checkpoints)
        control.barrier()


def _write_models(path: Path, store: ModelStore, groups: ProcessGroups) -> None:
    for name, slot in store.slots.items():
        if name in store.ema and slot.module is not None:  # a reference the EMA changes: its weights, no engine
            with _on_device(slot, store.device):
                save_checkpoint(slot.module, path / name / "hf", tokenizer_from=slot.entry.path)
            if slot.ema_master:  # its fp32 master (bf16/fp16 weights), this rank's shard: a resume mixes on from it
                (path / name / "ema").mkdir(parents=True, exist_ok=True)
                torch.save(slot.ema_master, path / name / "ema" / f"rank{store.rank}.pt")
        if slot.engine is None:
            continue
        engine = slot.engine
        assert slot.module is not None, f"{name}: an engine without its module"  # build_engine wraps the home shard
        if slot.cfg.lora is not None:
            with _gathered_adapters(slot):
                save_adapters(slot.module, path / name / "adapter", slot.entry.path)
        else:
            save_checkpoint(slot.module, path / name / "hf", tokenizer_from=slot.entry.path,
                            gathered=zero3_gathered if slot.entry.zero_stage == 3 else None)
        with barriers_on(_engine_group(groups, slot, store.rank)), engine_groups(engine):
            engine.save_checkpoint(str(path / name / "engine"), tag=ENGINE_TAG, save_latest=False)


def load(trial_dir: Path, store: ModelStore, groups: ProcessGroups, control: Control, algo_state: AlgoState,
         master: Master | None, buffer: RolloutBuffer | None = None) -> int:
    """Restore the last whole checkpoint into ``store``'s models, the RNG, ``algo_state`` and ``master`` (rank 0's
    data cursor; None elsewhere); returns the step to continue from."""
    path = checkpoint_dir.latest(trial_dir)
    if path is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {checkpoint_dir.checkpoints_root(trial_dir)}; "
                              "run without --resume to start afresh")
    manifest = json.loads((path / "manifest.json").read_text())
    for name, slot in store.slots.items():
        if name in store.ema and slot.module is not None:
            _load_weights(slot, path / name / "hf", groups, store)
            saved_master = path / name / "ema" / f"rank{store.rank}.pt"
            # none saved: an fp32 reference, or not mixed yet (its master is then its weights, made at the next mix)
            slot.ema_master = safe_load(saved_master, map_location="cpu") if saved_master.is_file() else {}
        if slot.engine is None:
            continue
        engine = slot.engine
        with (barriers_on(_engine_group(groups, slot, store.rank)), engine_groups(engine),
              _safe_engine_loads(engine)):
            loaded, _ = engine.load_checkpoint(str(path / name / "engine"), tag=ENGINE_TAG)
        if loaded is None:
            raise CheckpointError(f"{path / name / 'engine'}: DeepSpeed found no state for rank {store.rank}; "
                                  "resume with the same schedule and number of ranks")
    _repair_exports(path, manifest, store, control)
    if any_rank(not finite_weights(_trained(store)), dist.group.WORLD, store.device):
        # the master reads the older checkpoints' files, on this failure path only
        raise CheckpointError(control.bcast(nonfinite_refusal(trial_dir, path) if control.is_master else None))
    state = safe_load(path / "ranks" / f"rank{store.rank}.pt")
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    algo_state.load_state_dict(state["algo"])
    if buffer is not None:
        buffer.load_state_dict(state.get("rollout_buffer", {"entries": []}))
    if master is not None:
        master.load_checkpoint_state(manifest)
    dist.barrier()
    return int(manifest["step"])


def _lora_models(store: ModelStore) -> list[str]:
    """The trained LoRA models, whose ``adapter/`` export every checkpoint holds (the same list on every rank)."""
    return [name for name, slot in store.slots.items() if slot.entry.trainable and slot.cfg.lora is not None]


def _repair_exports(path: Path, manifest: dict[str, Any], store: ModelStore, control: Control) -> None:
    """Collective: rewrite each LoRA export of checkpoint ``path`` that is not what was saved (the master checks,
    ``export_check.bad_exports``) from the engine state just loaded, and say so in one line each."""
    models = _lora_models(store)
    bad = control.bcast(bad_exports(path, models, manifest) if control.is_master and models else None) or {}
    for name in models:
        slot = store.slots[name]
        if export_path(name) in bad and slot.engine is not None:
            assert slot.module is not None, f"{name}: an engine without its module"
            with _gathered_adapters(slot):
                save_adapters(slot.module, path / name / "adapter", slot.entry.path)
    if bad:
        control.barrier()  # every export rewritten
    if control.is_master:
        recorded = manifest.get(EXPORTS_KEY) or {}
        for rel, why in bad.items():
            same = (" (its SHA-256 now equals the one recorded at save)"
                    if recorded.get(rel) == sha256(path / rel) else "")
            print(f"restage: {path / rel}: {why}; rewritten from {path.name}/{rel.split('/')[0]}/engine, the state "
                  f"this resume loaded{same}", flush=True)


def nonfinite_refusal(trial_dir: Path, path: Path) -> str:
    """The one line refusing checkpoint ``path`` (non-finite weights), naming the newest older checkpoint whose
    saved weights (every ``<model>/hf/``) are all finite, and the ones to move aside to resume from it."""
    steps = checkpoint_dir.complete_steps(trial_dir)
    bad = int(path.name.split("-")[1])
    finite = next((s for s in reversed(steps) if s < bad
                   and finite_files(checkpoint_dir.final_dir(trial_dir, s))), None)
    if finite is None:
        return (f"{path}: holds non-finite weights, and no older checkpoint of {trial_dir} has finite ones; start the "
                "trial afresh (--overwrite)")
    newer = [f"step-{s}" for s in steps if s > finite]
    return (f"{path}: holds non-finite weights; the newest finite checkpoint is step-{finite}: rename "
            f"{', '.join(newer)} in {checkpoint_dir.checkpoints_root(trial_dir)} (e.g. to {newer[-1]}.nonfinite) to "
            "resume from it, or start the trial afresh")


def safe_load(path: Path, map_location: MAP_LOCATION = None, allowed: Sequence[Callable[..., object]] = ()) -> Any:
    """``torch.load`` that cannot run code: tensors, containers and plain values, plus the ``allowed`` classes.

    A checkpoint is data; a pickle can name any callable, and ``weights_only=False`` would call it on
    ``--resume``. A file that needs anything else is refused in one line.
    """
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        what = next((line.strip() for line in str(e).splitlines() if "GLOBAL" in line or "global" in line),
                    str(e).splitlines()[0] if str(e) else "unsupported content")
        raise CheckpointError(f"{path}: not loaded, it holds a Python object that loading would have to construct "
                              f"or call ({what}); restore it from a trusted copy or resume from another "
                              "checkpoint") from None


def _deepspeed_state_types() -> list[Callable[..., object]]:
    """The classes DeepSpeed's engine and ZeRO optimizer files hold besides tensors and containers (listed by
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on its files), allowed in a weights-only load."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def _safe_engine_loads(engine: Engine) -> Iterator[None]:
    """DeepSpeed's engine reads its files through ``engine.checkpoint_engine.load``, with ``weights_only=False``;
    for the block, it reads them through ``safe_load`` instead (DeepSpeed has no switch for it)."""
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.load
    allowed = _deepspeed_state_types()
    checkpoint_engine.load = lambda path, map_location=None: safe_load(Path(path), map_location, allowed)
    try:
        yield
    finally:
        checkpoint_engine.load = original


def _load_weights(slot: ModelSlot, hf_dir: Path, groups: ProcessGroups, store: ModelStore) -> None:
    """Overwrite a frozen model's home shard with the weights a checkpoint saved (a reference the EMA changed)."""
    module = slot.module
    assert module is not None, f"{slot.name}: no home shard to load into"  # callers check it
    saved = load_stage(hf_dir, slot.home, groups, store.rank, module.dtype, store.device)
    with torch.no_grad():
        for param, value in zip(module.parameters(), saved.parameters(), strict=True):
            param.copy_(value)


@contextlib.contextmanager
def _on_device(slot: ModelSlot, device: torch.device) -> Iterator[None]:
    """An offloaded model back on the device for the block (saving gathers over TP, which NCCL does on the GPU)."""
    offloaded = slot.host_copy if slot.host_copy is not None and slot.host_copy.location == "host" else None
    if offloaded is not None:
        offloaded.reload(device)
    try:
        yield
    finally:
        if offloaded is not None:
            offloaded.offload()  # the host copy is still current: nothing is copied back


def zero3_gathered(params: Sequence[torch.nn.Parameter]) -> contextlib.AbstractContextManager[object]:
    """ZeRO-3's partitions of ``params`` gathered over their DP group for the block (collective over it); what
    ``save_checkpoint`` enters once per unit."""
    import deepspeed  # lazy: seconds to import, and only ZeRO-3 models gather

    gathered: contextlib.AbstractContextManager[object] = deepspeed.zero.GatheredParameters(list(params),
                                                                                            modifier_rank=None)
    return gathered


@contextlib.contextmanager
def _gathered_adapters(slot: ModelSlot) -> Iterator[None]:
    """A LoRA model's adapters (what ``save_adapters`` writes, a small fraction of the model) whole for the block
    under ZeRO-3; its frozen base is never gathered."""
    assert slot.module is not None  # only slots with an engine, which wraps the module, are saved
    if slot.entry.zero_stage != 3:
        yield
        return
    with zero3_gathered([p for n, p in slot.module.named_parameters() if is_adapter(slot.cfg, n)]):
        yield
