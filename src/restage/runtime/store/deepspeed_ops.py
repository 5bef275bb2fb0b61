"""DeepSpeed's compiled ops: built once per node before any engine needs them, never by every rank at once.

DeepSpeed compiles an op that was not prebuilt (``DS_BUILD_<OP>=1 pip install deepspeed``) the
first time it is loaded, into torch's extension cache under torch's file lock (``<build dir>/lock``),
which holds no process id and is only removed by its holder: every loader, built or not, takes it
briefly, and a process killed while holding it leaves it behind; every later load then waits
forever without a word.

So restage (1) builds into a directory of its own per user and per torch/DeepSpeed version
(``extensions_dir``; ``TORCH_EXTENSIONS_DIR`` if set wins), and (2) loads every op under its own
lock, ``<build dir>/restage.lease`` (``restage.locks.HostLock``), with the holder's pid and host in
``restage.holder``. The lock is a lease (a marker file created exclusively and renewed by its holder), not
an ``flock``: it works where ``flock`` fails (Lustre without ``flock``, NFS without locks: ENOSYS, ENOLCK)
and across nodes, where ``flock`` on some NFS set-ups is node-local and would let two nodes build into
one directory at once. A dead holder's lease is broken at once on its own host, after ``LEASE_SECONDS``
without renewal from another. A rank waiting for a live holder says who it waits for; one that gets
the lock and still finds torch's ``lock`` knows its maker is dead (no live process holds restage's
lock, and none on this host has the file open), reports it and removes it.

restage trains with torch's own AdamW on GPUs (multi-tensor CUDA kernels, nothing to compile,
no nvcc on compute nodes; see ``runtime.store.zero_engines.deepspeed_config``), so the only op it needs there
is ``cpu_adam``, for ZeRO optimizer offload; on CPU ranks DeepSpeed's communication backend also
loads ``deepspeed_shm_comm``. ``prepare_ops`` makes one rank per node load (and if needed build)
them while the others wait at a barrier; then they load the finished build, one at a time.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from restage.errors import LaunchError
from restage.locks import HostLock
from restage.runtime.control.channels import arrive

if TYPE_CHECKING:  # importing mpi4py initializes MPI; the caller holds the communicator
    from mpi4py import MPI

_BUILDERS = {"cpu_adam": "CPUAdamBuilder", "deepspeed_shm_comm": "ShareMemCommBuilder"}
NOTICE_SECONDS = 30.0  # while waiting for another build, say so at most this often


def _unnamed(activity: str, waiting: bool = False) -> None:
    """The default ``doing``: no heartbeat to name the activity to."""


class TrainSpec(Protocol):
    """What ``needed_ops`` reads of a model (a config's ``ModelSpec``)."""

    @property
    def trainable(self) -> bool: ...

    @property
    def offload_optimizer(self) -> bool: ...


def needed_ops(specs: Iterable[TrainSpec], accelerator: str = "cuda") -> list[str]:
    """The compiled DeepSpeed ops the trainable models need (``ModelSpec`` or schedule ``ModelEntry`` values).

    On DeepSpeed's cpu accelerator every engine's communication backend also loads its
    shared-memory all-reduce op (``deepspeed_shm_comm``) when it starts.
    """
    specs = list(specs)
    names = ["cpu_adam"] if any(s.trainable and s.offload_optimizer for s in specs) else []
    if accelerator == "cpu" and any(s.trainable for s in specs):
        names.append("deepspeed_shm_comm")
    return names


def extensions_dir(env: Mapping[str, str] = os.environ) -> Path:
    """restage's extension cache: per user (their cache directory) and per Python, torch (with its CUDA or CPU
    tag) and DeepSpeed version. torch puts builds directly under a ``TORCH_EXTENSIONS_DIR`` it is given."""
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    versions = "-".join([f"py{sys.version_info.major}{sys.version_info.minor}",
                         *(f"{package}{_version(package)}" for package in ("torch", "deepspeed"))])
    return cache / "restage" / "torch_extensions" / versions


def use_extensions_dir(env: MutableMapping[str, str] = os.environ) -> Path:
    """Point torch's JIT builds at ``extensions_dir`` unless ``TORCH_EXTENSIONS_DIR`` is set; returns the one used."""
    return Path(env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(env))))


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "none"


def _builder(name: str) -> Any:  # a DeepSpeed OpBuilder (DeepSpeed has no type information)
    # lazy: DeepSpeed takes seconds to import; only when an op is built
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(_BUILDERS[name])


def _prebuilt(name: str) -> bool:
    # lazy: DeepSpeed takes seconds to import
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(name))


def lock_path(name: str) -> Path:
    """The lock torch's extension loader takes while it loads or builds ``name``."""
    # lazy: cpp_extension pulls in setuptools; only to find the build lock
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / "lock"


def local_openers(path: Path) -> list[int]:
    """Pids of the processes on this host that have ``path`` open (torch's lock holder keeps it open)."""
    target = str(path)
    found = []
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                found.append(int(fd_dir.parent.name))
        except OSError:
            continue  # gone, or not ours to read
    return found


@contextlib.contextmanager
def build_lock(name: str, *, say: Callable[[str], None] = print,
               doing: Callable[..., None] = _unnamed,
               poll_seconds: float = 0.2, notice_seconds: float = NOTICE_SECONDS) -> Iterator[None]:
    """Hold restage's lock on ``name``'s build directory; on the way in, wait for a live holder (saying who) and
    remove torch's lock if its maker is dead."""
    torch_lock = lock_path(name)
    torch_lock.parent.mkdir(parents=True, exist_ok=True)
    lock = HostLock(torch_lock.parent, "restage")
    waited_since, said_at = time.monotonic(), -notice_seconds
    while True:
        if not lock.try_acquire():
            holder = f"{lock.holder()}, which holds restage's build lock"
        else:
            openers = [pid for pid in local_openers(torch_lock) if pid != os.getpid()]
            if not openers:
                break
            lock.release()  # a build outside restage: wait for it too
            holder = f"pid {openers[0]} on {socket.gethostname()}, which holds torch's build lock"
        now = time.monotonic()
        if now - said_at >= notice_seconds:
            said_at = now
            say(f"restage: rank waits for {holder} of DeepSpeed's {name} op ({torch_lock.parent}); "
                f"{now - waited_since:.0f} s so far")
            doing(f"start-up: waiting for {holder} of {name}", waiting=True)
        time.sleep(poll_seconds)
    try:
        if torch_lock.exists():
            say(f"restage: removing {torch_lock}: left by {lock.holder()}, which died while loading or building "
                f"{name} (no live process holds restage's build lock or has the file open)")
            torch_lock.unlink(missing_ok=True)
        lock.name_holder()
        yield
    finally:
        lock.release()  # a holder that dies instead leaves its lease, which the next one breaks (restage.locks)


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


def locked_load(name: str, *, load: Callable[[str], None] = load_op,
                doing: Callable[..., None] = _unnamed) -> None:
    """``load(name)`` under ``build_lock`` (a prebuilt op takes no lock: nothing is built)."""
    if _prebuilt(name):
        load(name)
        return
    with build_lock(name, say=lambda line: print(line, file=sys.stderr, flush=True), doing=doing):
        doing(f"start-up: loading (building if needed) DeepSpeed's {name} op")
        load(name)


def prepare_ops(names: Iterable[str], *, node_leader: bool, node_barrier: Callable[[], None],
                load: Callable[[str], None] = load_op,
                doing: Callable[..., None] = _unnamed) -> None:
    """Every rank calls this before building its engines: the node leader builds, then everyone loads.

    ``node_barrier`` waits for every rank of this node (an MPI barrier on the node's communicator);
    ``doing(activity, waiting=)`` names each step to the rank's heartbeat.
    """
    names = list(names)
    if not names:
        return
    if node_leader:
        for name in names:
            locked_load(name, load=load, doing=doing)
    doing(f"start-up: waiting for this node's build of {', '.join(names)}", waiting=True)
    node_barrier()
    if not node_leader:
        for name in names:
            locked_load(name, load=load, doing=doing)


def prepare_run_ops(comm: MPI.Comm, specs: Iterable[TrainSpec], doing: Callable[..., None] = _unnamed) -> None:
    """``prepare_ops`` for a run over the MPI world ``comm`` (collective: every rank calls it with the same specs)."""
    names = needed_ops(specs, os.environ.get("DS_ACCELERATOR", "cuda"))
    if not names:
        return
    # lazy: importing mpi4py initialises MPI; only ranks call this
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        prepare_ops(names, node_leader=node.Get_rank() == 0, node_barrier=lambda: arrive(node), doing=doing)
    finally:
        node.Free()
