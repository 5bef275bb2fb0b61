"""A LoRA actor's checkpoints hold its adapters in PEFT's layout (no base weights), and a run stopped after step 2
and resumed ends with the adapters of a run that never stopped; a corrupted export in the checkpoint resumed from
is said and rewritten from the engine state."""

import json

import pytest
import torch
from runs import hf_weights, restage_run

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/grpo_tiny.yaml", "-n", "2", "run.batch_size=4", "algo.group_size=4", "run.steps=3", "run.save_every=1",
       "run.keep_checkpoints=3", "models.actor.lora.rank=4", "models.actor.optim.lr=5.0e-3", "plan.mode=manual",
       "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
       "plan.layouts.actor_train=ranks:0-1 tp2"]


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_lora_checkpoints_hold_peft_adapters_and_resume_exactly(tmp_path):
    _ok(restage_run(tmp_path, *JOB, "trial=straight"))
    straight = tmp_path / "grpo-tiny" / "straight" / "checkpoints"
    actor = straight / "step-3" / "actor"
    assert sorted(p.name for p in actor.iterdir()) == ["adapter", "engine"]
    config = json.loads((actor / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["target_modules"]) == (
        "LORA", 4, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])  # all-linear
    first, last = hf_weights(straight / "step-1" / "actor" / "adapter"), hf_weights(actor / "adapter")
    assert len(last) == 2 * 7 * 2  # A and B of the 7 linears in each of the tiny model's 2 layers
    assert all(k.startswith("base_model.model.model.layers.") for k in last)
    assert any(not torch.equal(first[k], last[k]) for k in last)  # trained between the checkpoints

    _ok(restage_run(tmp_path, *JOB, "trial=split", "run.stop_at_step=2"))
    # The export a user loads, corrupted in the checkpoint the resume reads its engine state from: said and rewritten.
    export = tmp_path / "grpo-tiny" / "split" / "checkpoints" / "step-2" / "actor" / "adapter" / "adapter_model.safetensors"
    saved = export.read_bytes()
    assert saved == (straight / "step-2" / "actor" / "adapter" / "adapter_model.safetensors").read_bytes()
    export.write_bytes(saved[:-8] + bytes(8))
    done = restage_run(tmp_path, "jobs/grpo_tiny.yaml", "-n", "2", "trial=split", "--resume")
    _ok(done)
    assert [line for line in done.stdout.splitlines() if "rewritten from" in line] == [
        f"restage: {export}: its SHA-256 differs from the one recorded at save; rewritten from step-2/actor/engine, "
        "the state this resume loaded (its SHA-256 now equals the one recorded at save)"]
    assert export.read_bytes() == saved
    resumed = hf_weights(tmp_path / "grpo-tiny" / "split" / "checkpoints" / "step-3" / "actor" / "adapter")
    assert resumed.keys() == last.keys() and all(torch.equal(resumed[k], last[k]) for k in last)
