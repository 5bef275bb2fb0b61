"""DeepSpeed's compiled ops: built once per node before any engine needs them, never by every rank at once.

DeepSpeed compiles an op that was not prebuilt (``DS_BUILD_<OP>=1 pip install deepspeed``) the
first time it is loaded, into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``) under a file lock that holds no process id. Ranks loading at once
queue on that lock; a rank killed while compiling leaves it behind, and every later load on the
machine then waits forever without a word.

restage trains with torch's own AdamW on GPUs (multi-tensor CUDA kernels, nothing to compile,
no nvcc on compute nodes; see ``runtime.engines.deepspeed_config``), so the only op it needs there
is ``cpu_adam``, for ZeRO optimizer offload; on CPU ranks DeepSpeed's communication backend also
loads ``deepspeed_shm_comm``. ``prepare_ops`` makes one rank per node load (and if needed build)
them while the others wait at a barrier; then they load the finished build.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from restage.errors import LaunchError

# Building cpu_adam takes about a minute; a lock this old belongs to a build that was killed.
STALE_LOCK_SECONDS = 600.0
_BUILDERS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}


def needed_ops(specs: Iterable, accelerator: str = "cuda") -> list[str]:
    """The compiled DeepSpeed ops the trainable models of a config need (``ModelSpec`` values).

    On DeepSpeed's cpu accelerator every engine's communication backend also loads its
    shared-memory all-reduce op (``deepspeed_shm_comm``) when it starts.
    """
    specs = list(specs)
    names = ["cpu_adam"] if any(s.trainable and s.offload_optimizer for s in specs) else []
    if accelerator == "cpu" and any(s.trainable for s in specs):
        names.append("deepspeed_shm_comm")
    return names


def _builder(name: str):
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(_BUILDERS[name])


def _prebuilt(name: str) -> bool:
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(name))


def lock_path(name: str) -> Path:
    """The lock torch's extension loader takes while it builds ``name``."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / "lock"


def clear_stale_lock(name: str, stale_seconds: float = STALE_LOCK_SECONDS, now: float | None = None) -> bool:
    """Remove ``name``'s build lock if it is older than ``stale_seconds`` (a killed build's); True if removed."""
    path = lock_path(name)
    try:
        age_seconds = (time.time() if now is None else now) - path.stat().st_mtime
    except FileNotFoundError:
        return False
    if age_seconds < stale_seconds:
        return False
    print(f"restage: removing {path}, left {age_seconds:.0f} s ago by a build of {name} that did not finish", flush=True)
    path.unlink(missing_ok=True)
    return True


def load_op(name: str) -> None:
    """Load ``name`` (compiling it into the extension cache first if it was not prebuilt); one-line error if it cannot."""
    if _prebuilt(name):
        return
    builder = _builder(name)
    if not builder.is_compatible(verbose=False):
        raise LaunchError(f"DeepSpeed's {name} op cannot be built on {os.uname().nodename}; prebuild it "
                          f"(DS_BUILD_{name.upper()}=1 pip install deepspeed) or turn off offload_optimizer")
    try:
        builder.load(verbose=False)
    except Exception as err:
        raise LaunchError(f"building DeepSpeed's {name} op failed ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
                          f"prebuild it (DS_BUILD_{name.upper()}=1 pip install deepspeed) or turn off offload_optimizer"
                          ) from None


def prepare_ops(names: Iterable[str], *, node_leader: bool, node_barrier: Callable[[], None],
                load: Callable[[str], None] = load_op, stale_seconds: float = STALE_LOCK_SECONDS) -> None:
    """Every rank calls this before building its engines: the node leader builds, then everyone loads.

    ``node_barrier`` waits for every rank of this node (an MPI barrier on the node's communicator).
    """
    names = list(names)
    if not names:
        return
    if node_leader:
        for name in names:
            if not _prebuilt(name):
                clear_stale_lock(name, stale_seconds)
            load(name)
    node_barrier()
    if not node_leader:
        for name in names:
            load(name)


def prepare_run_ops(comm, specs: Iterable) -> None:
    """``prepare_ops`` for a run over the MPI world ``comm`` (collective: every rank calls it with the same specs)."""
    names = needed_ops(specs, os.environ.get("DS_ACCELERATOR", "cuda"))
    if not names:
        return
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        prepare_ops(names, node_leader=node.Get_rank() == 0, node_barrier=node.Barrier)
    finally:
        node.Free()
