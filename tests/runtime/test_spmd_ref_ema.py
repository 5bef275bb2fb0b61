"""Reference EMA: after every actor step the reference becomes (1 - eta) ref + eta actor, across layouts and resumes."""

import pytest
import torch
from runs import hf_weights, restage_run, tiny_assets

from restage.report.log import read_log
from restage.runtime.checkpoint.run_state import safe_load
from restage.schedule.file import read_schedule

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

ETA = 0.25
# The actor trains tp2 and the reference lives dp2, so every mix is a reallocation between layouts.
JOB = ["jobs/grpo_tiny.yaml", "-n", "2", "run.batch_size=4", "algo.group_size=4", "run.steps=3", "run.save_every=1",
       "run.keep_checkpoints=3", f"algo.ref_ema_eta={ETA}", "plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2",
       "plan.layouts.ref_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2"]


def _ok(done):
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_reference_follows_the_actor_by_ema_and_resumes_exactly(tmp_path):
    _ok(restage_run(tmp_path, *JOB, "trial=straight"))
    straight = tmp_path / "grpo-tiny" / "straight"
    kinds = [op.kind for op in read_schedule(straight / "schedule.json").ops()]
    assert kinds.count("ema") == 1 and kinds.index("ema") == len(kinds) - 1  # right after actor_train, the last MFC
    ref = hf_weights(tiny_assets())
    for step in (1, 2, 3):
        checkpoint = straight / "checkpoints" / f"step-{step}"
        actor, mixed = hf_weights(checkpoint / "actor" / "hf"), hf_weights(checkpoint / "ref" / "hf")
        assert mixed.keys() == actor.keys() == ref.keys()
        for name in ref:
            expected = (1 - ETA) * ref[name] + ETA * actor[name]
            torch.testing.assert_close(mixed[name], expected, rtol=0, atol=1e-6, msg=f"step {step} {name}")
        assert any(not torch.equal(mixed[n], ref[n]) for n in ref)  # it really moved
        ref = mixed
    log = read_log(straight)
    emas = [row for row in log.transfers if row["kind"] == "realloc" and row["name"] == "ema:ref"]
    assert sorted({int(row["step"]) for row in emas}) == [1, 2, 3]
    assert sum(row["num_bytes"] for row in emas if int(row["step"]) == 1) > 0  # tp2 -> dp2 sends half the actor

    # Offloaded between its MFCs, the reference is mixed where it waits (host memory): same weights.
    _ok(restage_run(tmp_path, *JOB, "trial=offloaded", "models.ref.offload_when_idle=true"))
    trial = tmp_path / "grpo-tiny" / "offloaded"
    assert [op.kind for op in read_schedule(trial / "schedule.json").ops()].count("offload") == 1
    offloaded = hf_weights(trial / "checkpoints" / "step-3" / "ref" / "hf")
    assert all(torch.equal(offloaded[k], ref[k]) for k in ref)

    # Stopped after step 2 and resumed: the reference comes back from the checkpoint, not from its base model.
    _ok(restage_run(tmp_path, *JOB, "trial=split", "run.stop_at_step=2"))
    _ok(restage_run(tmp_path, "jobs/grpo_tiny.yaml", "-n", "2", "trial=split", "--resume"))
    split = tmp_path / "grpo-tiny" / "split" / "checkpoints" / "step-3"
    for model in ("actor", "ref"):
        a, b = hf_weights(straight / "checkpoints" / "step-3" / model / "hf"), hf_weights(split / model / "hf")
        assert all(torch.equal(a[k], b[k]) for k in a), model


@pytest.mark.scale  # about 50 s: make test's time bound
def test_bf16_reference_mixes_in_its_fp32_master_and_resumes_bit_for_bit(tmp_path):
    # bf16 actor and reference; the reference lives tp2, so each rank's fp32 master (ref/ema/rank<R>.pt) is another
    # half, and the actor trains dp2: every mix is still a reallocation between layouts.
    job = [*JOB[:-3], "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 tp2",
           "plan.layouts.actor_train=ranks:0-1 dp2", "models.actor.dtype=bf16", "models.ref.dtype=bf16"]
    straight, split = (tmp_path / "grpo-tiny" / trial / "checkpoints" for trial in ("straight", "split"))
    started = [restage_run(tmp_path, *job, "trial=straight", wait=False),
               restage_run(tmp_path, *job, "trial=split", "run.stop_at_step=2", wait=False)]
    for run in started:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, out[-3000:]
    assert not (split / "step-3").exists()
    _ok(restage_run(tmp_path, "jobs/grpo_tiny.yaml", "-n", "2", "trial=split", "--resume"))

    initial = {k: v.to(torch.bfloat16) for k, v in hf_weights(tiny_assets()).items()}
    ref = hf_weights(straight / "step-3" / "ref" / "hf")
    assert {v.dtype for v in ref.values()} == {torch.bfloat16}
    assert sum(int((ref[k] != initial[k]).sum()) for k in ref) > sum(v.numel() for v in ref.values()) // 2  # it moved
    for model in ("actor", "ref"):
        a, b = hf_weights(straight / "step-3" / model / "hf"), hf_weights(split / "step-3" / model / "hf")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), f"{model} {name}"
    # A resume that remade the master from the bf16 weights instead would leave some of them one rounding off.
    for rank in (0, 1):
        masters = [safe_load(run / "step-3" / "ref" / "ema" / f"rank{rank}.pt") for run in (straight, split)]
        assert {v.dtype for v in masters[0].values()} == {torch.float32}
        assert masters[0].keys() == masters[1].keys()
        for name in masters[0]:
            assert torch.equal(masters[0][name], masters[1][name]), f"rank {rank} master {name}"
