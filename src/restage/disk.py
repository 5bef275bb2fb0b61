"""Writes that can fill a disk: telling "no space left" from other errors, and saying so in one line.

A full file system shows up in many shapes: ``OSError`` with ``errno`` ENOSPC (Python, h5py),
a ``SafetensorError`` whose text carries "os error 28", or a bare ``RuntimeError`` from
``torch.save`` ("unexpected pos ...", "iostream error") that has lost the errno. ``writing``
turns each of them into one ``DiskFullError`` naming the mount point and what was being written;
every other error passes through unchanged.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from restage.errors import DiskFullError

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "storagefull", "os error 28", "errno = 28")
# Below this, an I/O error that lost its errno (torch.save's) is taken to be the disk filling up.
NEARLY_FULL_BYTES = 1 << 20


def free_bytes(path: str | Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path`` (or its nearest existing parent)."""
    try:
        stats = os.statvfs(_existing(Path(path)))
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def is_disk_full(err: BaseException, path: str | Path | None = None) -> bool:
    """Whether ``err`` (or an error it was raised from) is the file system of ``path`` running out of space."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in _FULL_ERRNOS:
            return True
        if any(text in str(seen).lower() for text in _FULL_TEXTS):
            return True
        seen = seen.__cause__ or seen.__context__
    if path is not None and isinstance(err, (OSError, RuntimeError)):
        free = free_bytes(path)
        return free is not None and free < NEARLY_FULL_BYTES
    return False


def place(path: str | Path) -> str:
    """The mount point holding ``path`` and its file system type, e.g. ``/scratch (tmpfs)``."""
    here = _existing(Path(path).absolute())
    mount = here
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    kind = ""
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and fields[1] == str(mount):
                kind = fields[2]  # the last mount on a point is the one in use
    except OSError:
        pass
    return f"{mount} ({kind})" if kind else str(mount)


@contextmanager
def writing(what: str, path: str | Path) -> Iterator[None]:
    """Run a write of ``what`` under ``path``; a full disk there is raised as one ``DiskFullError``."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err, path):
            raise
        raise DiskFullError(f"no space left on {place(path)} while writing {what} ({path}); free space there "
                            "(or move run.results_dir) and --resume") from err


def replace_atomically(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``: a reader sees the old file
    or the new one, never part of one. ``durable``: fsync the file and the rename (a machine crash keeps it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (best effort: some file systems refuse to fsync a directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
