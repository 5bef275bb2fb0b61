"""Nothing loaded from a checkpoint can run code: a crafted pickle in a rank's state or in DeepSpeed's optimizer
state is refused on --resume in one line, runs nothing, and leaves every file as it was."""

import hashlib
import os
import shutil

import pytest
import torch
from runs import last_checkpoint, restage_run

from restage.runtime.checkpoint.run_state import _deepspeed_state_types, safe_load

pytestmark = [pytest.mark.multirank, pytest.mark.e2e]

JOB = ["jobs/ppo_tiny.yaml", "-n", "2", "run.batch_size=8", "run.steps=3", "run.save_every=1", "plan.mode=manual",
       "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
       "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 dp2",
       "plan.layouts.critic_train=ranks:0-1 dp2"]


class Payload:
    """Unpickling this calls os.system: what ``torch.load(weights_only=False)`` would do with a crafted file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _digests(folder):
    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "code-ran"
    done = restage_run(tmp_path, *JOB, "trial=t", "run.stop_at_step=2")
    assert done.returncode == 0, done.stderr[-3000:]
    trial = tmp_path / "ppo-tiny" / "t"
    checkpoint = last_checkpoint(trial)
    rank_file = checkpoint / "ranks" / "rank0.pt"
    optim_file = sorted((checkpoint / "critic" / "engine" / "state").glob("zero_pp_rank_0_*optim_states.pt"))[0]
    # The real files load without running anything (DeepSpeed's few classes are allowed by name).
    state = safe_load(optim_file, allowed=_deepspeed_state_types())
    assert "optimizer_state_dict" in state

    for victim, crafted in ((rank_file, {"torch": torch.get_rng_state(), "algo": Payload(marker)}),
                            (optim_file, {"optimizer_state_dict": Payload(marker)})):
        kept = victim.with_name(victim.name + ".orig")
        shutil.copy2(victim, kept)
        torch.save(crafted, victim)
        before = _digests(trial / "checkpoints")
        done = restage_run(tmp_path, "jobs/ppo_tiny.yaml", "-n", "2", "trial=t", "--resume", timeout=300)
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert f"{victim}: not loaded, it holds a Python object" in last and "posix.system" in last, done.stderr[-2000:]
        assert not marker.exists()  # nothing ran
        assert _digests(trial / "checkpoints") == before  # and nothing written was touched
        shutil.move(kept, victim)
