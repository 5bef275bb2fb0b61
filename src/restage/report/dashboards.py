"""Dashboards: each step's scalars, as written to ``log.h5``, copied to TensorBoard and Weights & Biases.

``log.h5`` stays the source of truth; a dashboard is a copy made after the step is in the journal.
``attach(log, cfg, trial_dir, resume_step)`` (called by the master when it opens the log) registers a
``Dashboards`` observer on the ``LogWriter`` when the config's ``dashboards`` section asks for one:

* ``dashboards.tensorboard: true``: event files under ``<trial>/tensorboard`` (the ``tensorboard``
  extra), written with ``torch.utils.tensorboard``; a resumed run purges the steps after its checkpoint;
* ``dashboards.wandb: offline`` (files under ``<trial>/wandb``, ``wandb sync`` uploads them later) or
  ``online`` (the ``wandb`` extra, project ``dashboards.wandb_project``).

Scalars, by step (counted from 1 as in the log): every statistic of the log's ``stats`` table under
its own name (``actor_train/loss``, ``eval/reward``, ...), plus ``time/step_seconds`` and each MFC's
``time/<mfc>_seconds`` (first start to last end over its ranks, as the report measures it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from restage.config.schema import ExperimentConfig
from restage.errors import ConfigError


class Sink(Protocol):
    def write(self, step: int, scalars: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def step_scalars(rows: Mapping) -> dict[str, float]:
    """The scalars of one journal step (``{"steps", "mfcs", "stats", ...}`` rows, as ``LogWriter`` records them)."""
    out = {name: float(value) for _, name, value in rows.get("stats", ())}
    for _, start, end, *_ in rows.get("steps", ()):
        out["time/step_seconds"] = float(end) - float(start)
    spans: dict[str, tuple[float, float]] = {}
    for _, name, _model, _kind, _rank, start, end, *_ in rows.get("mfcs", ()):
        first, last = spans.get(name, (float(start), float(end)))
        spans[name] = (min(first, float(start)), max(last, float(end)))
    out.update({f"time/{name}_seconds": last - first for name, (first, last) in spans.items()})
    return out


class TensorBoardSink:
    def __init__(self, log_dir: Path, purge_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter  # optional: needs the `tensorboard` extra
        except ImportError:
            raise ConfigError("dashboards.tensorboard needs the tensorboard package; pip install 'restage[tensorboard]' "
                              "or set dashboards.tensorboard=false") from None
        self.writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg: ExperimentConfig, trial_dir: Path, resumed: bool):
        try:
            import wandb  # optional: the `wandb` extra
        except ImportError:
            raise ConfigError("dashboards.wandb needs the wandb package; pip install 'restage[wandb]' or set "
                              "dashboards.wandb=off") from None
        trial_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.dashboards.wandb_project, name=f"{cfg.experiment}/{cfg.trial}",
                              id=f"{cfg.experiment}-{cfg.trial}".replace("/", "-"), resume="allow" if resumed else None,
                              dir=str(trial_dir), mode=cfg.dashboards.wandb, config=cfg.to_dict())

    def write(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class Dashboards:
    """A ``LogWriter`` observer: ``step(rows)`` after each step is journaled, ``close()`` when the log closes."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def step(self, rows: Mapping) -> None:
        scalars = step_scalars(rows)
        for sink in list(self.sinks):
            try:
                sink.write(int(rows["step"]), scalars)
            except Exception as err:  # a dashboard is a copy: losing it must not stop the run or the log
                print(f"restage: dashboard {type(sink).__name__} failed at step {rows['step']} ({err}); it is "
                      "switched off, log.h5 has every step", file=sys.stderr, flush=True)
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def open_dashboards(cfg: ExperimentConfig, trial_dir: str | Path, resume_step: int | None = None) -> Dashboards | None:
    """The dashboards ``cfg.dashboards`` asks for, or None."""
    trial_dir = Path(trial_dir)
    sinks: list[Sink] = []
    if cfg.dashboards.tensorboard:
        sinks.append(TensorBoardSink(trial_dir / "tensorboard", None if resume_step is None else resume_step + 1))
    if cfg.dashboards.wandb != "off":
        sinks.append(WandbSink(cfg, trial_dir, resume_step is not None))
    return Dashboards(sinks) if sinks else None


def attach(log, cfg: ExperimentConfig, trial_dir: str | Path, resume_step: int | None = None) -> None:
    """Register the configured dashboards on ``log`` (a ``LogWriter``); nothing when none is configured."""
    dashboards = open_dashboards(cfg, trial_dir, resume_step)
    if dashboards is not None:
        log.observers.append(dashboards)
