"""The schedule: an execution plan as one JSON file that every rank reads (format in docs/plan.md).

``build_schedule`` writes a chosen plan down with everything the runtime needs and nothing it
must recompute: the config, the cluster, each model's architecture, checkpoint, dtype, ZeRO stage
and home layout, each MFC with its layout and micro-batch count, the steps of one iteration in
execution order (``runtime.program.Op`` records: run an MFC, reallocate or free a parameter
copy, transfer a key, offload or reload a frozen model), and the estimator's predictions.
``read_schedule`` refuses files of another format version.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from restage.errors import ConfigError
from restage.graph import MFC
from restage.layout import Layout
from restage.plan.evaluate import evaluate
from restage.plan.simulator import op_name, plan_ops
from restage.plan.transfer import key_bytes

SCHEDULE_FORMAT_VERSION = 1


@dataclass(frozen=True)
class Schedule:
    format_version: int
    experiment: str
    trial: str
    config: dict
    cluster: dict
    world_size: int
    models: dict  # name -> {arch, path, preset, trainable, dtype, zero_stage, ..., home_mfc, home_layout}
    mfcs: tuple  # dicts: MFC fields + layout + predicted
    steps: tuple  # dicts in execution order
    predicted: dict  # iteration_seconds, samples_per_second, flops_per_iteration, pflops_per_second, ...
    plan: dict  # mode, seed, search statistics, baselines

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"mfcs": list(self.mfcs), "steps": list(self.steps)}

    @classmethod
    def from_json(cls, data: dict) -> Schedule:
        version = data.get("format_version")
        if version != SCHEDULE_FORMAT_VERSION:
            raise ConfigError(f"schedule format_version {version!r} is not {SCHEDULE_FORMAT_VERSION}; "
                              f"run `restage plan` again with this version of restage")
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data))
        if missing:
            raise ConfigError(f"schedule lacks {missing}; run `restage plan` again")
        return cls(**{k: (tuple(data[k]) if k in ("mfcs", "steps") else data[k]) for k in fields})

    def mfc(self, name: str) -> MFC:
        for entry in self.mfcs:
            if entry["name"] == name:
                return MFC.from_json({k: entry[k] for k in _MFC_FIELDS})
        raise KeyError(name)

    def ops(self) -> list:
        """The steps as ``runtime.program.Op`` records, in the order every rank walks them."""
        from restage.runtime.program import Op

        def layout(d):
            return Layout.from_json(d) if d is not None else None

        return [Op(kind=s["kind"], ranks=tuple(s["ranks"]), mfc=s.get("mfc", ""), model=s.get("model", ""),
                   key=s.get("key", ""), producer=s.get("producer", ""), src=layout(s.get("src")), dst=layout(s.get("dst")))
                for s in self.steps]

    def layout(self, name: str) -> Layout:
        for entry in self.mfcs:
            if entry["name"] == name:
                return Layout.from_json(entry["layout"])
        raise KeyError(name)


_MFC_FIELDS = ("name", "kind", "model", "inputs", "outputs", "n_seqs", "prompt_tokens", "gen_tokens", "micro_batches",
               "minibatches", "epochs", "greedy", "options")


def build_schedule(cfg, outcome, exact: bool = True) -> Schedule:
    """The schedule of ``outcome`` (a planner.PlanOutcome); ``exact`` takes reallocation bytes from the runtime's planner."""
    problem, plan = outcome.problem, outcome.plan
    problem.exact_realloc = exact
    ev = evaluate(problem, plan)
    spans = {s.name: s for s in ev.timeline.spans}
    cluster = problem.cluster
    models = {}
    for name, role in problem.roles.items():
        if name not in problem.home:
            continue
        home = plan[problem.index[problem.home[name]]]
        models[name] = {"arch": role.arch.to_json(), "path": role.path, "preset": role.preset, "trainable": role.trainable,
                        "dtype": role.dtype, "zero_stage": role.zero_stage,
                        "gradient_checkpointing": role.gradient_checkpointing,
                        "offload_optimizer": role.offload_optimizer, "offload_params": role.offload_params,
                        "offload_when_idle": role.offload_when_idle, "home_mfc": problem.home[name],
                        "home_layout": home.layout.to_json()}
    mfcs = []
    for i, (mfc, cand) in enumerate(zip(problem.mfcs, plan)):
        entry = mfc.to_json() | {"micro_batches": cand.micro_batches, "layout": cand.layout.to_json()}
        span = spans[mfc.name]
        entry["predicted"] = {"seconds": cand.seconds, "peak_memory_bytes": ev.mfc_peak_memory_bytes[i],
                              "start_seconds": span.start_seconds, "end_seconds": span.end_seconds,
                              "source": cand.estimate.source, "breakdown": dict(cand.estimate.breakdown)}
        mfcs.append(entry)
    steps = []
    for i, op in enumerate(plan_ops(problem, plan)):
        entry = op.to_json()
        if op.kind != "free":
            span = spans[op_name(op, i)]
            entry["predicted"] = {"seconds": span.end_seconds - span.start_seconds, "start_seconds": span.start_seconds,
                                  "end_seconds": span.end_seconds}
        if op.kind == "realloc":
            entry["bytes"] = problem.realloc(op.model, op.src, op.dst).total_bytes
        elif op.kind == "ema":
            entry["bytes"] = problem.realloc(problem.graph[op.mfc].model, op.src, op.dst).total_bytes
        elif op.kind == "transfer":
            entry["bytes"] = key_bytes(problem.graph[op.mfc], op.key)
        steps.append(entry)
    flops = problem.iteration_flops()
    predicted = {"iteration_seconds": ev.iteration_seconds, "samples_per_iteration": problem.samples_per_iteration,
                 "samples_per_second": problem.samples_per_iteration / ev.iteration_seconds,
                 "flops_per_iteration": flops, "pflops_per_second": flops / ev.iteration_seconds / 1e15,
                 "peak_memory_bytes": ev.peak_memory_bytes, "usable_memory_bytes": problem.capacity_bytes,
                 "estimator": sorted({c.estimate.source for c in plan}),
                 "iteration_overlap": problem.overlap_iterations}
    info = {"mode": outcome.mode, "seed": cfg.seed,
            "baselines": {name: (None if b is None else {"iteration_seconds": b.iteration_seconds,
                                                         "peak_memory_bytes": b.peak_memory_bytes})
                          for name, b in outcome.baselines.items()}}
    if outcome.search is not None:
        s = outcome.search
        info["search"] = {"method": s.method, "steps": s.steps, "wall_seconds": s.wall_seconds, "stopped_by": s.stopped_by,
                          "top_iteration_seconds": [e.iteration_seconds for _, e in s.top]}
    return Schedule(SCHEDULE_FORMAT_VERSION, cfg.experiment, cfg.trial, cfg.to_dict(), cluster.to_json(), cluster.world_size,
                    models, tuple(mfcs), tuple(steps), predicted, info)


def write_schedule(schedule: Schedule, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(schedule.to_json(), indent=1) + "\n")
    tmp.replace(path)  # readers never see half a file
    return path


def read_schedule(path: str | Path) -> Schedule:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"schedule {path} does not exist; run `restage plan CONFIG` first")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"schedule {path} is not valid JSON ({err.msg}); run `restage plan` again") from None
    return Schedule.from_json(data)
