"""The append-only journal beside ``log.h5``: one checksummed line per completed step (why: ``report.log``).

A journal is a header line ``restage-log-journal <id>`` and then lines ``<crc32 hex> <JSON>``; the
JSON holds a step's rows, table by table, as lists in the columns' order. Lines are only appended,
each with one ``write``; a line cut short (a kill, a full disk) or failing its checksum ends what a
reader takes, so every line before it stays readable.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from restage.disk import replace_atomically

MAGIC = "restage-log-journal"
SUFFIX = ".journal"


def journal_path(log_path: Path) -> Path:
    """``log.h5`` -> ``log.h5.journal``."""
    return log_path.with_name(log_path.name + SUFFIX)


def create(path: Path, journal_id: str) -> None:
    """Replace ``path`` whole by an empty journal of ``journal_id``."""
    replace_atomically(path, f"{MAGIC} {journal_id}\n".encode())


def encode(record: dict) -> bytes:
    """One journal line for ``record`` (NaN and infinities kept, as JSON's ``NaN``/``Infinity``)."""
    text = json.dumps(record, separators=(",", ":")).encode()
    return b"%08x %s\n" % (zlib.crc32(text), text)


def read(path: Path, journal_id: str) -> list[dict]:
    """The records of the journal of ``journal_id`` at ``path``, up to its first damaged line.

    A missing journal, or one of another id (a log replaced since), has no records.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")  # the last item is what follows the last newline: empty, or a torn line
    if not journal_id or lines[0] != f"{MAGIC} {journal_id}".encode():
        return []
    records = []
    for line in lines[1:-1]:
        crc, _, text = line.partition(b" ")
        try:
            if int(crc, 16) != zlib.crc32(text):
                break
            records.append(json.loads(text))
        except ValueError:
            break
    return records


class Appender:
    """Appends lines to a journal; a line that fails to write is cut off again, so the file ends on a whole line."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        self.size_bytes = os.fstat(self._fd).st_size

    def append(self, line: bytes) -> None:
        view = memoryview(line)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except BaseException:
            try:
                os.ftruncate(self._fd, self.size_bytes)
            except OSError:
                pass  # the reader stops at the torn line anyway
            raise
        self.size_bytes += len(line)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
