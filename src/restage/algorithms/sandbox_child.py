"""The sandboxed process of ``algorithms/sandbox.py``: confine itself, then run an answer and one test.

Run as ``python -I -B sandbox_child.py`` with a JSON request on stdin (``code``, ``test``, ``limits``,
``nonce``, ``forbidden_reads``, ``read_roots``, ``namespaces``) and a throwaway working directory as its
cwd. Standard library only, every import at the top: once confined, the interpreter's own directory may
be unreadable. In order, each fence taken when the kernel allows it (``confine``):

* the network: as root a new, empty network namespace, then the uid/gid ``nobody``; without root a new
  user namespace with its own empty network namespace (unprivileged user namespaces);
* Landlock (Linux 5.13+): files may be written only in the working directory and read only under
  ``read_roots`` (the interpreter's libraries, system directories) and there; other processes' ``/proc``
  files, signals to them (6.12+) and, where no network namespace was had, TCP (6.7+) are refused;
* resource limits; then an audit hook that refuses writes outside the working directory, reads of other
  processes' ``/proc`` and of ``forbidden_reads``, new processes, signals, sockets, ``ctypes`` and frame
  inspection (the last fence, and the only one a kernel without the above leaves).

Then the answer and the test run, and only if both finish does the nonce (which the answer never sees)
reach stdout, followed by the fences that held (``network=... files=...``) for the parent to report.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
NOBODY = 65534
PR_SET_NO_NEW_PRIVS = 38
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446  # the same on every arch
LANDLOCK_RULE_PATH_BENEATH = 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
TRUNCATE = 1 << 14
FS_RIGHTS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
REFUSED = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.startfile",
           "subprocess.Popen", "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "socket.__new__",
           "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "ctypes.dlopen", "ctypes.dlsym",
           "ctypes.cdata", "ctypes.call_function", "sys._getframe", "sys._current_frames", "gc.get_referrers",
           "gc.get_objects", "gc.get_referents", "os.setuid", "os.setgid", "mmap.__new__", "os.chroot"}
PATH_CHANGES = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1, "os.chown": 1,
                "os.symlink": 2, "os.link": 2, "os.truncate": 1, "os.utime": 1, "shutil.rmtree": 1,
                "os.listxattr": 0, "os.setxattr": 1, "os.removexattr": 1, "shutil.copyfile": 2, "shutil.move": 2}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1  # struct landlock_path_beneath_attr is packed
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock(libc, workdir: str, read_roots: list[str], tcp: bool) -> tuple[bool, bool]:
    """Writes only under ``workdir``, reads only there and under ``read_roots``; with ``tcp`` no TCP bind or connect.

    Returns (files fenced, TCP fenced); (False, False) where the kernel has no Landlock."""
    libc.syscall.restype = ctypes.c_long
    abi = libc.syscall(LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 1:
        return False, False
    fs = FS_RIGHTS_BY_ABI.get(abi, FS_RIGHTS_BY_ABI[5])
    net = NET_BIND_TCP | NET_CONNECT_TCP if tcp and abi >= 4 else 0
    attr = _RulesetAttr(fs, net, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return False, False
    file_rights = fs & (EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE)
    rules = [(workdir, fs)] + [(root, EXECUTE | READ_FILE | READ_DIR) for root in read_roots]
    rules.append(("/dev/null", file_rights))
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a root this machine lacks
        if not os.path.isdir(path):
            rights &= file_rights
        rule = _PathBeneath(rights, fd)
        libc.syscall(LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH),
                     ctypes.byref(rule), ctypes.c_uint32(0))
        os.close(fd)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    done = libc.syscall(LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) == 0
    os.close(ruleset)
    return done, done and bool(net)


def confine(request: dict, workdir: str) -> dict[str, str]:
    """Every fence the kernel allows (see the module's docstring); returns which held, by what: network and files."""
    libc = ctypes.CDLL(None, use_errno=True)
    network, files = "hook", "hook"
    if request.get("namespaces", True):
        if os.geteuid() == 0:
            network = "namespace" if libc.unshare(CLONE_NEWNET) == 0 else network
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            files = "uid"
        elif libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:  # refused where unprivileged user namespaces are off
            network = "namespace"
    fenced_files, fenced_tcp = landlock(libc, workdir, request["read_roots"], tcp=network != "namespace")
    files = "landlock" if fenced_files else files
    network = "landlock-tcp" if fenced_tcp else network
    limits = request["limits"]
    cpu_seconds = int(limits["cpu_seconds"])
    for which, value in ((resource.RLIMIT_AS, limits["memory_bytes"]), (resource.RLIMIT_CPU, cpu_seconds),
                         (resource.RLIMIT_NPROC, limits["processes"]), (resource.RLIMIT_FSIZE, limits["file_bytes"]),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(which, (int(value), int(value)))
    return {"network": network, "files": files}


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
    fences = confine(request, os.getcwd())
    sys.addaudithook(make_hook(os.getcwd(), request["forbidden_reads"]))
    scope = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(request["code"], "answer.py", "exec"), scope)
        exec(compile(request["test"], "test.py", "exec"), scope)
    except BaseException:  # the answer's own SystemExit too: only running to the end passes
        traceback.print_exc(limit=3)
        return 1
    sys.stdout.write(f"\n{nonce} network={fences['network']} files={fences['files']}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os._exit(main())  # no atexit or finalisers the answer may have registered
