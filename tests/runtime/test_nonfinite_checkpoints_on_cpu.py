"""--resume from a checkpoint with non-finite weights is refused naming the newest finite checkpoint, and which to
move aside to resume from it (runtime/checkpoint/run_state.py nonfinite_refusal; the ranks' check calls it)."""

import json

import torch
from safetensors.torch import save_file

from restage.runtime.checkpoint.run_state import nonfinite_refusal
from restage.runtime.step.nonfinite import finite_files


def _checkpoint(trial, step, finite):
    path = trial / "checkpoints" / f"step-{step}"
    for model in ("actor", "critic"):
        (path / model / "hf").mkdir(parents=True)
        weight = torch.ones(4, 3)
        if not finite and model == "critic":
            weight[1, 2] = float("nan")
        save_file({"w": weight, "steps": torch.tensor([step])}, str(path / model / "hf" / "model.safetensors"))
    (path / "manifest.json").write_text(json.dumps({"step": step}))
    return path


def test_the_refusal_names_the_newest_finite_checkpoint(tmp_path):
    trial = tmp_path / "trial"
    paths = {step: _checkpoint(trial, step, finite=step < 3) for step in (1, 2, 3, 4)}
    assert [finite_files(p) for p in paths.values()] == [True, True, False, False]
    assert nonfinite_refusal(trial, paths[4]) == (
        f"{paths[4]}: holds non-finite weights; the newest finite checkpoint is step-2: rename step-3, step-4 in "
        f"{trial / 'checkpoints'} (e.g. to step-4.nonfinite) to resume from it, or start the trial afresh")


def test_with_no_finite_checkpoint_it_says_to_start_afresh(tmp_path):
    trial = tmp_path / "trial"
    paths = [_checkpoint(trial, step, finite=False) for step in (2, 4)]
    assert nonfinite_refusal(trial, paths[-1]) == (
        f"{paths[-1]}: holds non-finite weights, and no older checkpoint of {trial} has finite ones; start the trial "
        "afresh (--overwrite)")
