"""Measured compute profiles (``cluster/profiles/*.json``, ``~/.cache/restage/profiles/``): the table ``restage profile`` writes.

A profile holds seconds measured on one device kind for one architecture's pieces (see
``profiler.py``) over a grid of (batch, seq) per TP size. ``lookup`` interpolates bilinearly
in (log batch, log seq) on log seconds inside the grid; beyond the largest batch or sequence it
scales linearly with the excess, below the smallest it keeps the smallest point's time
(small kernels are overhead-bound).
"""

from __future__ import annotations

import json
import math
import os
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from restage.cluster import cluster_dirs
from restage.errors import ConfigError
from restage.models.arch import ModelConfig

PROFILE_FORMAT_VERSION = 1
OPS = ("embed_forward", "block_forward", "block_backward", "prefill", "decode_step", "head_forward", "head_backward",
       "optimizer_step_per_param")
_SIGNATURE_FIELDS = ("family", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size", "activation",
                     "head_dim", "qk_norm", "num_experts", "experts_per_token", "moe_intermediate_size")


def arch_signature(cfg: ModelConfig) -> tuple[object, ...]:
    """The fields a block's cost depends on (not the layer count, which the profile does not time)."""
    return tuple(getattr(cfg, f) for f in _SIGNATURE_FIELDS)


@dataclass(frozen=True)
class ProfileEntry:
    op: str
    tp: int
    batch: float
    seq: float
    seconds: float


@dataclass
class Profile:
    """One measured table; ``name`` is the file it came from."""

    name: str
    cluster: str
    dtype: str
    arch: ModelConfig
    entries: list[ProfileEntry]
    meta: dict[str, object] = field(default_factory=dict)  # how it was measured (device, torch, grid)

    def __post_init__(self) -> None:
        grid: dict[tuple[str, int], dict[tuple[float, float], float]] = defaultdict(dict)
        for e in self.entries:
            grid[(e.op, e.tp)][(e.batch, e.seq)] = e.seconds
        self._grid = dict(grid)

    def matches(self, cluster: str, cfg: ModelConfig, dtype: str) -> bool:
        return self.cluster == cluster and self.dtype == dtype and arch_signature(self.arch) == arch_signature(cfg)

    def lookup(self, op: str, batch: float, seq: float, tp: int) -> float | None:
        """Seconds of ``op`` at (batch, seq) for this tp, or None when the profile has no such table."""
        table = self._grid.get((op, tp))
        if not table:
            return None
        batches = sorted({b for b, _ in table})
        seqs = sorted({s for _, s in table})
        scale = 1.0
        if batch > batches[-1]:
            scale *= batch / batches[-1]
        if seq > seqs[-1]:
            scale *= seq / seqs[-1]
        b = min(max(batch, batches[0]), batches[-1])
        s = min(max(seq, seqs[0]), seqs[-1])
        return scale * _bilinear(table, batches, seqs, b, s)

    def to_json(self) -> dict[str, object]:
        return {"format_version": PROFILE_FORMAT_VERSION, "cluster": self.cluster, "dtype": self.dtype,
                "arch": self.arch.to_json(), "meta": self.meta,
                "entries": [{"op": e.op, "tp": e.tp, "batch": e.batch, "seq": e.seq, "seconds": e.seconds}
                            for e in self.entries]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], name: str = "profile") -> Profile:
        if data.get("format_version") != PROFILE_FORMAT_VERSION:
            raise ConfigError(f"profile {name}: format_version {data.get('format_version')!r} is not "
                              f"{PROFILE_FORMAT_VERSION}; run `restage profile` again")
        entries = [ProfileEntry(e["op"], int(e["tp"]), float(e["batch"]), float(e["seq"]), float(e["seconds"]))
                   for e in data["entries"]]
        return cls(name, data["cluster"], data["dtype"], ModelConfig.from_json(data["arch"]), entries, data.get("meta", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def _bilinear(table: dict[tuple[float, float], float], batches: list[float], seqs: list[float], b: float,
              s: float) -> float:
    def bracket(values: list[float], x: float) -> tuple[float, float, float]:
        i = min(max(bisect_right(values, x) - 1, 0), len(values) - 1)
        lo, hi = values[i], values[min(i + 1, len(values) - 1)]
        w = 0.0 if hi == lo else (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return lo, hi, w

    b0, b1, wb = bracket(batches, b)
    s0, s1, ws = bracket(seqs, s)
    keys = ((b0, s0), (b1, s0), (b0, s1), (b1, s1))
    corners = [table.get(k) for k in keys]
    if any(c is None or c <= 0 for c in corners):  # a ragged grid: take the nearest measured point
        nearest = min(table, key=lambda k: abs(math.log(k[0] / b)) + abs(math.log(k[1] / s)))
        return table[nearest]
    logs = [math.log(table[k]) for k in keys]
    low = logs[0] * (1 - wb) + logs[1] * wb
    high = logs[2] * (1 - wb) + logs[3] * wb
    return math.exp(low * (1 - ws) + high * ws)


def user_profile_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where ``restage profile`` writes by default: the user's cache, never the repository."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "restage" / "profiles"


def profile_dirs() -> list[Path]:
    """Searched in order: each cluster directory's ``profiles/`` ($RESTAGE_CLUSTER_DIR, ./cluster, the
    repository's), then the user's cache (so a profile kept with the clusters wins over a local measurement)."""
    return [d / "profiles" for d in cluster_dirs()] + [user_profile_dir()]


def find_profile(cluster: str, cfg: ModelConfig, dtype: str) -> Profile | None:
    """The first profile under ``cluster/profiles/`` measured on ``cluster`` for this architecture and dtype."""
    seen = set()
    for d in profile_dirs():
        if not d.is_dir():
            continue
        for path in sorted(d.glob("*.json")):
            if path.resolve() in seen:
                continue
            seen.add(path.resolve())
            try:
                profile = load_profile(path)
            except (ConfigError, KeyError, ValueError, TypeError):
                continue  # another format or a broken file: not ours to use
            if profile.matches(cluster, cfg, dtype):
                return profile
    return None


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"profile {path} is not valid JSON ({err.msg}); run `restage profile` again") from None
    return Profile.from_json(data, name=path.name)
