"""The sandboxed process of ``algorithms/sandbox.py``: confine itself, then run an answer and one test.

Run as ``python -I -B sandbox_child.py`` with a JSON request on stdin (``code``, ``test``, ``limits``,
``nonce``, ``forbidden_reads``) and a throwaway working directory as its cwd. Standard library only,
every import at the top: once the uid is dropped, the interpreter's own directory may be unreadable.
In order: (as root) a new, empty network namespace and the uid/gid ``nobody``; resource limits;
an audit hook that refuses writes outside the working directory, reads of other processes'
``/proc`` and of ``forbidden_reads``, new processes, signals, sockets, ``ctypes`` and frame
inspection; then the answer and the test run, and only if both finish does the nonce (which the
answer never sees) reach stdout.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

CLONE_NEWNET = 0x40000000
NOBODY = 65534
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REFUSED = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.startfile",
           "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
           "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "ctypes.dlopen", "ctypes.dlsym",
           "ctypes.cdata", "ctypes.call_function", "sys._getframe", "sys._current_frames", "gc.get_referrers",
           "gc.get_objects", "gc.get_referents", "os.setuid", "os.setgid", "mmap.__new__", "os.chroot"}
PATH_CHANGES = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1, "os.chown": 1,
                "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "os.listxattr": 0, "os.setxattr": 1, "os.removexattr": 1, "shutil.copyfile": 2, "shutil.move": 2}


def confine(limits: dict) -> str:
    """Network namespace and uid (as root), then rlimits; returns how the network was cut ("namespace" or "hook")."""
    network = "hook"
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWNET) == 0:
            network = "namespace"
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    cpu_seconds = int(limits["cpu_seconds"])
    for which, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, cpu_seconds),
                         (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (int(value), int(value)))
    return network


def make_hook(workdir: str, forbidden_reads: list[str]):
    inside = os.path.realpath(workdir) + os.sep
    own_proc = (f"/proc/{os.getpid()}/", "/proc/self/", "/proc/thread-self/")

    def resolved(path) -> str | None:
        if isinstance(path, int):
            return None  # an fd already open
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        return os.path.realpath(os.path.join(workdir, os.fspath(path)))

    def outside(path) -> bool:
        where = resolved(path)
        return where is not None and not (where + os.sep).startswith(inside)

    def hook(event: str, args: tuple) -> None:
        if event in REFUSED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            where = resolved(path)
            if where is None:
                return
            writes = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & WRITE_FLAGS)
            if writes and outside(path):
                raise PermissionError(f"sandbox: writing {where} (outside the working directory) is not allowed")
            if (where.startswith("/proc/") and not where.startswith(own_proc)) or any(
                    (where + os.sep).startswith(root.rstrip(os.sep) + os.sep) for root in forbidden_reads):
                raise PermissionError(f"sandbox: reading {where} is not allowed")
        elif event in PATH_CHANGES:
            for path in args[:PATH_CHANGES[event]]:
                if outside(path):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed")

    return hook


def main() -> int:
    request = json.loads(sys.stdin.read())
    nonce = request.pop("nonce")
    confine(request["limits"])
    sys.addaudithook(make_hook(os.getcwd(), request["forbidden_reads"]))
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(request["code"], "answer.py", "exec"), scope)
        exec(compile(request["test"], "test.py", "exec"), scope)
    except BaseException:  # the answer's own SystemExit too: only running to the end passes
        traceback.print_exc(limit=3)
        return 1
    sys.stdout.write(f"\n{nonce}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os._exit(main())  # no atexit or finalisers the answer may have registered
