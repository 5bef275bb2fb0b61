"""How many ranks a job has, where each one runs, and which device it gets.

Ranks are placed in blocks: global rank ``r`` runs on node ``r // ranks_per_node`` as local
rank ``r % ranks_per_node``. On GPU nodes every rank sees ALL of its node's GPUs
(``CUDA_VISIBLE_DEVICES`` = the node's list as SLURM or the user gave it: NCCL needs them all
visible for NVLink/P2P between local ranks) and uses device index ``LOCAL_RANK`` among them,
which is what DeepSpeed's ``set_device(LOCAL_RANK)`` and ``torch.cuda.set_device`` pick.
If the launcher already bound one GPU per task (``srun --gpus-per-task=1``: one entry), that
entry is the rank's GPU and its device index is 0 (see ``device_binding``).
Block placement keeps the tensor-parallel ranks of a layout (adjacent ranks, see
``restage.layout``) on one node, which is what the planner assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

from restage.cluster import load_cluster
from restage.errors import ConfigError, LaunchError


@dataclass(frozen=True)
class JobGeometry:
    """The shape of one job: ``nodes`` x ``ranks_per_node`` ranks; ``gpus_per_node`` is 0 on CPU nodes."""

    nodes: int
    ranks_per_node: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ConfigError(f"a job needs >= 1 node and >= 1 rank per node, got {self.nodes} x {self.ranks_per_node}")
        if self.gpus_per_node not in (0, self.ranks_per_node):
            raise ConfigError(f"{self.gpus_per_node} GPUs per node for {self.ranks_per_node} ranks per node: "
                              "restage runs one rank per GPU")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int
    local_rank: int
    device: int | None  # the node-local GPU index, None on CPU nodes


def node_devices(cfg) -> tuple[int, bool]:
    """(devices per node, whether they are GPUs) for an ExperimentConfig.

    The one place the launcher couples to the cluster spec: ``cluster.devices_per_node`` in the
    config wins; 0 means "as ``cluster/<cluster.name>.yaml`` says". A spec whose device names a
    CPU (``local-cpu``) gives CPU ranks (one per "device"), any other spec gives GPUs.
    """
    spec = load_cluster(cfg.cluster.name, cfg.cluster.nodes, cfg.cluster.devices_per_node or None)
    return spec.devices_per_node, "cpu" not in spec.device.lower()


def job_geometry(cfg) -> JobGeometry:
    """The geometry of the SLURM job for an ExperimentConfig: cluster.nodes x devices per node ranks.

    ``run.nprocs`` 0 (its default) means "not set": the job has as many ranks as the cluster gives. A value the
    user set (in the YAML or as an override) must equal that; one that does not is refused in one line.
    """
    if cfg.cluster.nodes < 1:
        raise ConfigError(f"cluster.nodes: {cfg.cluster.nodes} must be >= 1")
    devices, gpus = node_devices(cfg)
    geometry = JobGeometry(cfg.cluster.nodes, devices, devices if gpus else 0)
    if cfg.run.nprocs and cfg.run.nprocs != geometry.world_size:  # 0: not set, derived from the cluster
        raise ConfigError(f"run.nprocs={cfg.run.nprocs} but the cluster gives {geometry.nodes} node(s) x {devices} "
                          f"devices = {geometry.world_size} ranks; leave run.nprocs out (it is derived from the "
                          f"cluster) or set run.nprocs={geometry.world_size}")
    return geometry


def placement(rank: int, geometry: JobGeometry) -> RankPlacement:
    """Where global ``rank`` runs (block placement)."""
    if not 0 <= rank < geometry.world_size:
        raise ValueError(f"rank {rank} outside a world of {geometry.world_size}")
    node, local = divmod(rank, geometry.ranks_per_node)
    return RankPlacement(rank, node, local, local if geometry.gpus_per_node else None)


def placements(geometry: JobGeometry) -> list[RankPlacement]:
    return [placement(r, geometry) for r in range(geometry.world_size)]


@dataclass(frozen=True)
class DeviceBinding:
    """What one GPU rank is given: ``visible`` for CUDA_VISIBLE_DEVICES, ``index`` the device it uses among
    them (LOCAL_RANK for DeepSpeed), ``gpu`` the physical entry that index names."""

    visible: str
    index: int

    @property
    def gpu(self) -> str:
        return self.visible.split(",")[self.index]


def device_binding(local_rank: int, gpus_per_node: int, visible: str | None) -> DeviceBinding | None:
    """The device binding of one rank, or None to leave CUDA_VISIBLE_DEVICES alone (CPU ranks).

    ``visible`` is what the rank inherited: SLURM sets it to the job's GPUs on the node, possibly
    not 0..n-1; it is kept as given, and the rank uses entry ``local_rank`` of it. One entry while
    the node has several GPUs means the launcher bound this task to its own GPU: index 0.
    """
    if gpus_per_node <= 0:
        return None
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if not entries:
        entries = [str(i) for i in range(gpus_per_node)]
    if len(entries) == 1:
        return DeviceBinding(entries[0], 0)
    if local_rank >= len(entries):
        raise LaunchError(f"local rank {local_rank} has no GPU: this node shows {len(entries)} ({','.join(entries)})")
    return DeviceBinding(",".join(entries), local_rank)


def visible_device(local_rank: int, gpus_per_node: int, visible: str | None) -> str | None:
    """The ``CUDA_VISIBLE_DEVICES`` value for one rank (the node's whole list), or None for CPU ranks."""
    binding = device_binding(local_rank, gpus_per_node, visible)
    return None if binding is None else binding.visible
