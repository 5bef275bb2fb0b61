"""Fixtures the sandbox tests share: a directory a hostile answer would reach for, a loopback listener."""

import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest


@pytest.fixture()
def outside():
    """A world-writable directory outside the sandbox holding one file (world-writable too, so a uid alone, even
    ``nobody``'s, would not stop a write there: the sandbox's own fences must)."""
    root = Path(tempfile.mkdtemp(prefix="restage-victim-"))
    os.chmod(root, 0o777)
    (root / "keep.txt").write_text("precious")
    os.chmod(root / "keep.txt", 0o666)
    yield root
    shutil.rmtree(root)


@pytest.fixture()
def listener():
    """A TCP listener on loopback; yields (port, what it accepted)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.5)
    got: list = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                got.append(server.accept())
            except OSError:
                pass

    waiter = threading.Thread(target=accept)
    waiter.start()
    yield server.getsockname()[1], got
    stop.set()
    waiter.join()
    server.close()
