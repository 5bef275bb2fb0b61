"""Submit jobs to the local SLURM cluster and watch them (helpers for tests/slurm).

Real jobs are ``jobs/ppo_tiny.yaml`` (or ``grpo_tiny.yaml``) submitted from the repository root with
``restage submit``: two CPU ranks, the tiny random LLaMA of ``restage.demo``, and the demo's
manual plan, which generates with the actor in one layout (dp2) and trains it in another (tp2),
so every step reallocates parameters. The self-test program (``restage.launch.selftest``) is used
only where it shows what the runtime does not report: where each rank ran.
"""

import contextlib
import json
from pathlib import Path

import yaml
from slurm_queue import FINISHED, job_state, wait_until  # noqa: F401 (the tests import them from here)

from restage import cli

REPO = Path(__file__).resolve().parents[2]
SELFTEST = {
    "experiment": "slurmtest",
    "algorithm": "sft",
    "trial": "t",
    "models": {"actor": {"path": "unused", "trainable": True}},
    "cluster": {"name": "local-cpu", "nodes": 1, "devices_per_node": 3},
    "run": {"steps": 4},
    "algo": {"selftest_sleep_seconds": 0.0},
    # One node shared by the tests' jobs, side by side: not whole nodes; mpirun, as these tests were written for.
    "slurm": {"template": "local", "program": "restage.launch.selftest", "time_minutes": 5, "exclusive": False,
              "launcher": "mpirun"},
}
# The demo's plan (restage.demo): the actor trains in tp2 and generates in dp2, so it is reallocated every step.
RELAYOUT_PLAN = ("plan.mode=manual", "plan.layouts.actor_gen=ranks:0-1 dp2", "plan.layouts.ref_inf=ranks:0-1 dp2",
                 "plan.layouts.critic_inf=ranks:0-1 dp2", "plan.layouts.actor_train=ranks:0-1 tp2",
                 "plan.layouts.critic_train=ranks:0-1 dp2")
REAL_RANKS = 2
REFERENCE_STEPS = 20
SAVE_EVERY = 2


def real_overrides(results: Path, trial: str, *more: str) -> list[str]:
    """Overrides that put a shipped tiny job on the local cluster with its results under ``results``."""
    return [f"run.results_dir={results}", f"trial={trial}", "cluster.nodes=1", f"cluster.devices_per_node={REAL_RANKS}",
            f"run.nprocs={REAL_RANKS}", "slurm.template=local", "slurm.time_minutes=5", "slurm.exclusive=false",
            "slurm.launcher=mpirun", *more]


def reference_overrides() -> tuple[str, ...]:
    """The reference job (conftest.reference_run): jobs/ppo_tiny.yaml for REFERENCE_STEPS steps, a checkpoint
    every SAVE_EVERY steps, the relayout plan. The requeue and cancel tests run exactly this config."""
    return (f"run.steps={REFERENCE_STEPS}", f"run.save_every={SAVE_EVERY}", *RELAYOUT_PLAN)


def submit_real(config: str, results: Path, trial: str, *more: str, resume: bool = False) -> tuple[str, Path]:
    """``restage submit`` a shipped job (relative paths as a user in the repository would give them)."""
    with contextlib.chdir(REPO):
        args = ["submit", config, *real_overrides(results, trial, *more)] + (["--resume"] if resume else [])
        assert cli.main(args) == 0
    cfg = yaml.safe_load((REPO / config).read_text())
    trial_dir = results / cfg["experiment"] / trial
    return json.loads((trial_dir / "submission.json").read_text())["job_id"], trial_dir


def submit(config: Path, *overrides: str) -> str:
    assert cli.main(["submit", str(config), *overrides]) == 0
    data = yaml.safe_load(config.read_text())
    trial = Path(data["run"]["results_dir"]) / data["experiment"] / data.get("trial", "t")
    return json.loads((trial / "submission.json").read_text())["job_id"]


def wait_finished(job_id: str, timeout_seconds: float = 240) -> str:
    return wait_until(lambda: (s := job_state(job_id)) in FINISHED and s, timeout_seconds, f"job {job_id} to finish")


def slurm_output(trial_dir: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((trial_dir / "slurm").glob("*_log.out")))


def failure_report(trial_dir: Path) -> str:
    """What to show when a job did not complete: the tail of the ranks' output."""
    log = trial_dir / "output.log"
    text = log.read_text(errors="replace") if log.is_file() else slurm_output(trial_dir)
    return "\n".join(text.splitlines()[-40:])


def by_hand(world_size: int, steps: int) -> int:
    return sum((rank + 1) * step for step in range(1, steps + 1) for rank in range(world_size))


def log_rows(trial_dir: Path) -> list[int]:
    """The steps log.h5 has as complete (read live, as restage report would)."""
    from restage.errors import LogError
    from restage.report.log import read_log

    try:
        return [int(step) for step in read_log(trial_dir / "log.h5").steps["step"]]
    except (LogError, OSError, KeyError):  # not created yet, or created but not yet initialised
        return []


def stats_by_step(log) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in log.stats:
        out.setdefault(int(row["step"]), {})[str(row["name"])] = float(row["value"])
    return out


def hf_tensors(checkpoint: Path, model: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted((checkpoint / model / "hf").glob("*.safetensors")):
        tensors.update(load_file(file))
    assert tensors, f"no safetensors under {checkpoint / model / 'hf'}"
    return tensors
