"""Schedule format version 2 (typed execution, model entries, cluster and predictions) and the reading of version 1
files (schedule/legacy.py): a version-1 file is read into the typed Schedule a version-2 file of the same plan is."""

import dataclasses
import json
from pathlib import Path

from plan_helpers import ppo_config

from restage.cluster import ClusterSpec
from restage.config.optim import OptimConfig
from restage.plan.planner import make_plan
from restage.plan.schedule import build_schedule
from restage.schedule.execution import Async, Sync
from restage.schedule.file import SCHEDULE_FORMAT_VERSION, Schedule, read_schedule, write_schedule
from restage.schedule.model_entry import effective_zero_stage
from restage.schedule.predictions import IterationPrediction, MFCPrediction, PlanFacts

V1_FIXTURE = Path(__file__).parent / "data" / "schedule_v1_grpo_tiny_async.json"  # `restage plan` before version 2


def as_version_1(data: dict) -> dict:
    """A version-2 schedule's JSON as version 1 wrote it: no execution, no model fields beyond version 1's."""
    added = ("critic", "optim", "router_aux_loss_coef")
    models = {name: {k: v for k, v in m.items() if k not in added and (k != "shard_frozen" or v)}
              for name, m in data["models"].items()}
    return {k: v for k, v in data.items() if k != "execution"} | {"format_version": 1, "models": models}


def test_a_version_1_file_reads_into_the_schedule_version_2_writes(tmp_path):
    cfg = ppo_config("llama-tiny", "llama-tiny", cluster="local-cpu", batch=8, prompt=16, gen=16)
    critic = cfg.models["critic"]
    critic = dataclasses.replace(critic, optim=dataclasses.replace(critic.optim, lr=3e-4, warmup_steps=2))
    cfg = dataclasses.replace(cfg, models=cfg.models | {"critic": critic})
    schedule = build_schedule(cfg, make_plan(cfg, time_budget_seconds=2, max_steps=200))
    assert SCHEDULE_FORMAT_VERSION == 2 and schedule.execution == Sync()
    assert schedule.models["critic"].critic and not schedule.models["ref"].critic
    assert schedule.models["critic"].optim == OptimConfig(lr=3e-4, warmup_steps=2)
    path = write_schedule(schedule, tmp_path / "v2.json")
    assert read_schedule(path) == schedule
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(as_version_1(json.loads(path.read_text()))))
    assert read_schedule(old) == schedule


def test_the_committed_version_1_file_is_read_with_its_execution_and_model_settings(tmp_path):
    schedule = read_schedule(V1_FIXTURE)
    raw = json.loads(V1_FIXTURE.read_text())
    assert raw["format_version"] == 1 and isinstance(schedule, Schedule)
    assert schedule.execution == Async(staleness=1, push_every=1, partial=False)
    actor = schedule.models["actor"]
    assert actor.optim == OptimConfig(**raw["config"]["models"]["actor"]["optim"] | {"betas": (0.9, 0.95)})
    assert not actor.critic and actor.router_aux_loss_coef is None
    # The file's cluster fields as they were; fields added to ClusterSpec since (the CPU roofline's) take their defaults.
    assert isinstance(schedule.cluster, ClusterSpec) and schedule.cluster == ClusterSpec.from_json(raw["cluster"])
    assert {k: schedule.cluster.to_json()[k] for k in raw["cluster"]} == raw["cluster"]
    assert isinstance(schedule.predicted, IterationPrediction) and isinstance(schedule.plan, PlanFacts)
    assert all(isinstance(e.predicted, MFCPrediction) for e in schedule.mfcs)
    assert schedule.predicted.iteration_seconds == raw["predicted"]["iteration_seconds"]
    # Written again it is a version-2 file whose JSON keeps version 1's fields as they were.
    again = json.loads(write_schedule(schedule, tmp_path / "again.json").read_text())
    assert again["format_version"] == 2 and again["execution"] == {"mode": "async", "staleness": 1, "push_every": 1,
                                                                   "partial_rollouts": False}
    for key in ("predicted", "plan", "mfcs", "steps", "config"):
        assert again[key] == raw[key], key
    assert {k: again["cluster"][k] for k in raw["cluster"]} == raw["cluster"]  # and the newer fields' defaults
    kept = {k: v for k, v in again["models"]["actor"].items() if k in raw["models"]["actor"]}
    assert kept == raw["models"]["actor"]


def test_the_effective_zero_stage_is_written_once():
    entry = read_schedule(V1_FIXTURE).models["actor"]
    strategy = entry.home_layout.strategy
    assert entry.engine_zero_stage == effective_zero_stage(entry.zero_stage, entry.offload_optimizer, strategy.dp,
                                                           strategy.ep)
    assert effective_zero_stage(2, False, dp=1) == 0 and effective_zero_stage(2, True, dp=1) == 2
    assert effective_zero_stage(0, False, dp=4, ep=2) == 1
    assert dataclasses.replace(entry, zero_stage=3).engine_zero_stage == 3
