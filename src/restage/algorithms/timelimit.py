"""Calls with a wall-clock limit, run in worker processes that can be stopped: ``TimeLimitedWorkers``.

A Python thread cannot be stopped, so a call that never returns (a reward's ``while True: sleep(1)``) would
hold its thread, and the rank waiting on it, forever. ``TimeLimitedWorkers.call(fn, args, kwargs,
timeout_seconds)`` runs ``fn`` in one of up to ``workers`` long-lived worker processes; when the call passes
its limit, that worker's whole process group is killed (SIGKILL) and ``TimeLimitExceeded`` is raised, and the
next call starts a fresh worker. It is the one runner for anything user code does that may hang: rule rewards
(``algorithms/scoring.py``, ``rewards.timeout_seconds``) and, for the same reason, environments and tools.

Hand-written over ``multiprocessing.connection`` because ``concurrent.futures.ProcessPoolExecutor`` cannot stop
one running call (``Future.cancel`` only cancels calls not yet started; killing its worker by hand breaks the
whole pool, ``BrokenProcessPool``, for every other call), and a library that does kill on timeout (pebble)
would be a dependency for about a hundred lines.

A worker is a fresh interpreter (``subprocess``, not ``fork``: the rank's CUDA context, MPI state and threads
are not copied; not ``multiprocessing``'s spawn either, which would import the rank's ``__main__`` and so torch),
in its own session (a kill takes whatever it started along), with the parent's ``sys.path`` and working
directory, started on first use and kept: a call then costs a pickle round trip over a socket. Neither its
start-up nor its first load of a function (importing the function's module, and ``fn.prepare()`` where ``fn``
has one) counts against a call's limit; a load has ``LOAD_SECONDS`` (or the call's limit, if longer). ``fn`` and
its arguments must pickle (a module-level function, or an object of a module-level class); the result comes
back pickled, and what ``fn`` raised is raised by ``call``.
A worker exits when its parent does. Thread-safe: ``call`` blocks its thread; at most ``workers`` calls run at
once, the others wait (unlimited) for a free worker.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

LOAD_SECONDS = 60.0  # the limit on a worker's import of a function's module (not counted against a call's)
# The worker's first lines: read the parent's sys.path, then serve. Standard library only until then.
_BOOT = ("import sys; from multiprocessing.connection import Connection; c = Connection(int(sys.argv[1])); "
         "sys.path[:] = c.recv(); from restage.algorithms.timelimit import serve; serve(c)")


class TimeLimitExceeded(Exception):
    """A call ran past its limit; its worker was killed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"did not return within {seconds:g} s")
        self.seconds = seconds


class WorkerDied(RuntimeError):
    """A worker process ended in the middle of a call (the call exited the interpreter, or crashed it)."""


class _Worker:
    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno())],
                                            pass_fds=(theirs.fileno(),), start_new_session=True)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.loaded: set[bytes] = set()  # the pickled functions it has loaded
        self.conn.send(list(sys.path))
        self.conn.recv()  # "ready": the interpreter is up (its start-up is not part of any call's limit)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session: anything the call started goes too
        except (ProcessLookupError, PermissionError):
            pass
        self.process.wait()
        self.conn.close()


class TimeLimitedWorkers:
    """Up to ``workers`` worker processes that run calls with a wall-clock limit (see the module docstring)."""

    def __init__(self, workers: int) -> None:
        self._slots = threading.BoundedSemaphore(max(1, workers))
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def call(self, fn: Callable, args: Sequence = (), kwargs: Mapping[str, Any] | None = None,
             timeout_seconds: float | None = None) -> Any:
        """``fn(*args, **kwargs)`` in a worker; ``TimeLimitExceeded`` (the worker killed) when it has not returned
        within ``timeout_seconds`` (None: no limit). Raises what ``fn`` raised, ``pickle.PicklingError`` (or
        ``TypeError``, ``AttributeError``) when the call cannot be sent, ``WorkerDied`` when the worker ended."""
        # Pickled here: a call that cannot be sent leaves no trace in a worker.
        function, arguments = pickle.dumps(fn), pickle.dumps((tuple(args), dict(kwargs or {})))
        with self._slots:
            worker = self._take()
            try:
                if function not in worker.loaded:
                    status, value = self._exchange(worker, ("load", function, b""),
                                                   max(LOAD_SECONDS, timeout_seconds or 0.0))
                    if status == "raised":
                        raise value
                    worker.loaded.add(function)
                status, value = self._exchange(worker, ("call", function, arguments), timeout_seconds)
            except BaseException as err:
                self._drop(worker)
                if isinstance(err, (EOFError, OSError)):
                    raise WorkerDied(f"its worker process ended (exit code {worker.process.returncode})") from None
                raise
            self._give_back(worker)
        if status == "raised":
            raise value
        return value

    @staticmethod
    def _exchange(worker: _Worker, message: tuple[str, bytes, bytes], timeout_seconds: float | None) -> tuple:
        worker.conn.send(message)
        if not worker.conn.poll(None if timeout_seconds is None else max(0.0, timeout_seconds)):
            raise TimeLimitExceeded(timeout_seconds or 0.0)
        return worker.conn.recv()

    def _take(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError("TimeLimitedWorkers is closed")
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker()  # outside the lock: start-up takes a fraction of a second
        with self._lock:
            self._busy.add(worker)
            closed = self._closed
        if closed:
            self._drop(worker)
            raise RuntimeError("TimeLimitedWorkers is closed")
        return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
            if not self._closed:
                self._idle.append(worker)
                return
        worker.kill()

    def _drop(self, worker: _Worker) -> None:
        with self._lock:
            self._busy.discard(worker)
        worker.kill()

    @property
    def started(self) -> int:
        """Worker processes alive now (idle or in a call)."""
        with self._lock:
            return len(self._idle) + len(self._busy)

    def close(self) -> None:
        """Kill every worker, idle or in a call (a call in progress then raises ``WorkerDied``)."""
        with self._lock:
            self._closed = True
            workers, self._idle = [*self._idle, *self._busy], []
        for worker in workers:
            try:
                os.killpg(worker.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            worker.process.wait()

    def __enter__(self) -> TimeLimitedWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _exit_with(parent_pid: int) -> None:
    """End this worker once its parent is gone (a hung call would otherwise outlive a killed rank)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def serve(conn: Connection) -> None:
    """The worker's loop: receive a pickled call, run it, send back ("ok", value) or ("raised", exception)."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), daemon=True).start()
    conn.send("ready")
    loaded: dict[bytes, Callable] = {}
    while True:
        try:
            kind, function, arguments = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "load":
                fn = loaded[function] = pickle.loads(function)
                prepare = getattr(fn, "prepare", None)
                reply: tuple[str, Any] = ("ok", prepare() if callable(prepare) else None)
            else:
                args, kwargs = pickle.loads(arguments)
                reply = ("ok", loaded[function](*args, **kwargs))
        except Exception as err:  # the call's own error, raised again by the parent
            reply = ("raised", err)
        except BaseException as err:  # SystemExit, KeyboardInterrupt: the call's failure, not the parent's
            reply = ("raised", RuntimeError(f"{type(err).__name__}({err})"))
        try:
            conn.send(reply)
        except Exception as err:  # a result or exception that does not pickle
            conn.send(("raised", RuntimeError(f"{reply[0]} {type(reply[1]).__name__}, which cannot be sent back "
                                              f"from the worker process: {err}")))
