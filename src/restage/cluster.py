"""Cluster specs: nodes, devices per node, device FLOP/s and memory, links; read from ``cluster/*.yaml``.

A spec file describes one kind of node; the node count (and optionally the devices per node)
comes from the experiment config or the command line, so one file serves any cluster size.
Every quantity carries its unit in its name. Bandwidths are per device and per direction.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from restage.errors import ConfigError

_FLOAT_FIELDS = (
    "peak_fp32_flops_per_second", "peak_bf16_flops_per_second", "peak_fp16_flops_per_second",
    "memory_bandwidth_bytes_per_second", "intra_node_bandwidth_bytes_per_second", "intra_node_latency_seconds",
    "inter_node_bandwidth_bytes_per_second", "inter_node_latency_seconds", "compute_efficiency",
    "memory_efficiency", "network_efficiency", "usable_memory_fraction", "block_overhead_seconds", "attention_efficiency",
    "host_bandwidth_bytes_per_second", "thread_efficiency", "cache_bandwidth_bytes_per_second",
    "gemm_half_rows", "weight_read_bytes_per_second",
    *(f"{name}_overhead_seconds" for name in (
        "mfc", "sequence", "forward", "backward", "decode_step", "optimizer_step", "dp_step", "transfer", "realloc")),
)


def device_is_gpu(device: str) -> bool:
    """Whether a cluster's ``device`` name is a GPU's: one that names a CPU is not (also for a cluster read as JSON)."""
    return "cpu" not in device.lower()


@dataclass(frozen=True)
class ClusterSpec:
    """One homogeneous cluster of ``nodes`` nodes with ``devices_per_node`` devices each.

    Global rank ``r`` lives on node ``r // devices_per_node``. ``*_efficiency`` are the
    achievable fractions of the peak figures the roofline model uses; ``block_overhead_seconds``
    is the fixed cost of calling one transformer block (kernel launches), which dominates
    small decoding steps. The other ``*_overhead_seconds`` are the runtime's fixed host-side
    costs around the compute (per MFC call, per sequence, per micro-batch forward / backward, per
    decoding step, per optimizer step, per data transfer and reallocation between layouts);
    they are measured per machine (``bench/estimator.py --calibrate``) and 0 where unmeasured.
    """

    name: str
    device: str
    nodes: int
    devices_per_node: int
    peak_fp32_flops_per_second: float
    peak_bf16_flops_per_second: float
    peak_fp16_flops_per_second: float
    memory_bytes: int
    memory_bandwidth_bytes_per_second: float
    intra_node_bandwidth_bytes_per_second: float
    intra_node_latency_seconds: float
    inter_node_bandwidth_bytes_per_second: float
    inter_node_latency_seconds: float
    compute_efficiency: float = 0.5  # of peak, a large well-shaped GEMM (plan/gemm.py scales it by shape)
    attention_efficiency: float = 0.5  # of peak, flash attention's forward (backward: 2.5x its time)
    memory_efficiency: float = 0.8
    network_efficiency: float = 0.8
    usable_memory_fraction: float = 0.9
    block_overhead_seconds: float = 0.0
    host_bandwidth_bytes_per_second: float = 25.0e9  # device <-> host memory (offloading), per device
    mfc_overhead_seconds: float = 0.0  # per MFC call on a rank
    sequence_overhead_seconds: float = 0.0  # per sequence an MFC handles on a rank (per-sample host work)
    forward_overhead_seconds: float = 0.0  # per micro-batch forward (pipeline slot)
    backward_overhead_seconds: float = 0.0  # per micro-batch backward through the training engine
    decode_step_overhead_seconds: float = 0.0  # per generated token step (sampling, cache bookkeeping)
    optimizer_step_overhead_seconds: float = 0.0  # per optimizer step, beyond the per-parameter update
    # per optimizer step of a data-parallel model (dp > 1), beyond its collectives' modelled seconds: DeepSpeed's
    # flattening, averaging and partition bookkeeping around the gradient reduction, and its norm all-reduce
    dp_step_overhead_seconds: float = 0.0
    transfer_overhead_seconds: float = 0.0  # per data transfer between two different layouts
    realloc_overhead_seconds: float = 0.0  # per parameter reallocation
    # CPU ranks only (a GPU cluster leaves them unset; ``bench/cpu_rates.py`` measures them). A rank computes and
    # streams at ``thread_speedup`` times one thread's rate: each thread beyond the first adds ``thread_efficiency``
    # of one. ``threads_per_rank`` 0: the node's ``cores_per_node`` shared by its ``devices_per_node`` ranks (the
    # runtime's rule, ``runtime/control/threads.py``; ``cluster_from_config`` fills in the run's own count). An op
    # whose largest tensor fits ``cache_bytes`` streams at ``cache_bandwidth_bytes_per_second`` (0: no cache term).
    cores_per_node: int = 0
    threads_per_rank: int = 0
    thread_efficiency: float = 1.0
    cache_bytes: int = 0
    cache_bandwidth_bytes_per_second: float = 0.0
    # CPU ranks only, measured by ``bench/cpu_rates.py`` (0: the term is off). A CPU BLAS
    # GEMM of few rows reaches less of ``compute_efficiency``: ``rows / (rows + gemm_half_rows)``, normalised to 1 at
    # ``CPU_REFERENCE_ROWS`` (``plan/gemm.py``); and it reads its weight matrix (packing it into panels) at
    # ``weight_read_bytes_per_second`` before computing, a cost added to its FLOP time rather than overlapped with it.
    gemm_half_rows: float = 0.0
    weight_read_bytes_per_second: float = 0.0

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ConfigError(f"cluster {self.name}: nodes ({self.nodes}) and devices_per_node "
                              f"({self.devices_per_node}) must be >= 1")
        for name in (*_FLOAT_FIELDS, "cores_per_node", "threads_per_rank", "cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cluster {self.name}: {name} must not be negative")
        for name in ("compute_efficiency", "attention_efficiency", "memory_efficiency", "network_efficiency",
                     "usable_memory_fraction", "thread_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"cluster {self.name}: {name} must be in (0, 1]")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def has_gpus(self) -> bool:
        """Whether the devices are GPUs (a spec whose device names a CPU, like ``local-cpu``, has CPU ranks)."""
        return device_is_gpu(self.device)

    @property
    def usable_memory_bytes(self) -> int:
        """Memory per device a plan may fill (the rest is CUDA context, allocator slack)."""
        return int(self.memory_bytes * self.usable_memory_fraction)

    @property
    def rank_threads(self) -> int:
        """Threads one CPU rank computes with: ``threads_per_rank``, else the node's cores over its ranks (at least 1)."""
        if self.threads_per_rank:
            return self.threads_per_rank
        return max(1, self.cores_per_node // self.devices_per_node) if self.cores_per_node else 1

    @property
    def thread_speedup(self) -> float:
        """A CPU rank's compute and streaming rate over one thread's (1 on GPUs): ``1 + (threads - 1) x efficiency``."""
        return 1.0 if self.has_gpus else 1.0 + (self.rank_threads - 1) * self.thread_efficiency

    def stream_bandwidth(self, largest_tensor_bytes: float) -> float:
        """Bytes per second an op streams at when its largest tensor takes ``largest_tensor_bytes``: the cache's rate
        where it fits the cache (CPU clusters with a measured cache; a GPU's caches are not modelled), else memory's;
        times the rank's thread speedup."""
        if (not self.has_gpus and self.cache_bytes and self.cache_bandwidth_bytes_per_second
                and largest_tensor_bytes <= self.cache_bytes):
            return self.cache_bandwidth_bytes_per_second * self.thread_speedup
        return self.achievable_memory_bandwidth() * self.thread_speedup

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def peak_flops_per_second(self, dtype: str) -> float:
        try:
            return getattr(self, f"peak_{dtype}_flops_per_second")
        except AttributeError:
            raise ConfigError(f"dtype {dtype!r} has no peak FLOP/s in cluster {self.name}; use fp32, bf16 or fp16") from None

    def achievable_flops_per_second(self, dtype: str) -> float:
        return self.peak_flops_per_second(dtype) * self.compute_efficiency

    def achievable_memory_bandwidth(self) -> float:
        """Bytes per second of device memory a streaming kernel reaches."""
        return self.memory_bandwidth_bytes_per_second * self.memory_efficiency

    def link(self, ranks) -> tuple[float, float]:
        """(bytes per second per device, latency seconds) of the slowest link among ``ranks``."""
        nodes = {self.node_of(r) for r in ranks}
        if len(nodes) > 1:
            return self.inter_node_bandwidth_bytes_per_second * self.network_efficiency, self.inter_node_latency_seconds
        return self.intra_node_bandwidth_bytes_per_second * self.network_efficiency, self.intra_node_latency_seconds

    def with_size(self, nodes: int | None = None, devices_per_node: int | None = None) -> ClusterSpec:
        """The same kind of node, ``nodes`` of them (``None`` or 0 keeps the current value)."""
        return dataclasses.replace(self, nodes=nodes or self.nodes, devices_per_node=devices_per_node or self.devices_per_node)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ClusterSpec:
        return _build(data, "cluster")

    def describe(self) -> str:
        return f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {self.device}"


def cluster_dirs() -> list[Path]:
    """Where cluster files are looked up: $RESTAGE_CLUSTER_DIR, ./cluster, then the repository's cluster/."""
    dirs = []
    if os.environ.get("RESTAGE_CLUSTER_DIR"):
        dirs.append(Path(os.environ["RESTAGE_CLUSTER_DIR"]))
    dirs += [Path.cwd() / "cluster", Path(__file__).resolve().parents[2] / "cluster"]
    return dirs


def cluster_names() -> list[str]:
    names: set[str] = set()
    for d in cluster_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def find_cluster_file(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if path.is_file():
            return path
        raise ConfigError(f"cluster file {path} does not exist")
    for d in cluster_dirs():
        candidate = d / f"{name_or_path}.yaml"
        if candidate.is_file():
            return candidate
    raise ConfigError(f"cluster {name_or_path!r} is unknown; use one of {', '.join(cluster_names()) or '(none found)'} "
                      f"or a path to a cluster YAML file")


def load_cluster(name_or_path: str, nodes: int | None = None, devices_per_node: int | None = None) -> ClusterSpec:
    """Read ``cluster/<name>.yaml`` (or a path); ``nodes`` / ``devices_per_node`` override the file's."""
    path = find_cluster_file(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        raise ConfigError(f"{path}: not valid YAML; fix the syntax") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return _build(data, str(path)).with_size(nodes, devices_per_node)


def cluster_from_config(cfg) -> ClusterSpec:
    """The cluster an ExperimentConfig names (``cluster.name``, ``cluster.nodes``, ``cluster.devices_per_node``), with
    the threads each CPU rank will run: ``run.threads_per_rank``, else ``OMP_NUM_THREADS`` of this process's
    environment (which the ranks inherit), as the runtime's rule takes them (``runtime/control/threads.py``);
    unset, the spec's cores over ranks."""
    ref = cfg.cluster
    spec = load_cluster(ref.name, ref.nodes, ref.devices_per_node or None)
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    threads = cfg.run.threads_per_rank or (int(omp) if omp.isdigit() else 0)
    return dataclasses.replace(spec, threads_per_rank=threads) if threads else spec


def _build(data: dict, source: str) -> ClusterSpec:
    fields = {f.name: f for f in dataclasses.fields(ClusterSpec)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{source}: unknown keys {unknown}; known keys: {', '.join(fields)}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{source}: missing keys {missing}")
    values: dict[str, Any] = {}  # one value per ClusterSpec field, each converted to its field's type below
    for name, value in data.items():
        try:
            if name in _FLOAT_FIELDS:
                values[name] = float(value)  # YAML 1.1 reads 312e12 as a string
            elif name in ("nodes", "devices_per_node", "memory_bytes", "cores_per_node", "threads_per_rank",
                          "cache_bytes"):
                values[name] = int(float(value))
            else:
                values[name] = str(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{source}: {name}: expected a number, got {value!r}") from None
    return ClusterSpec(**values)
