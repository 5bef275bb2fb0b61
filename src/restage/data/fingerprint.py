"""What data a trial trained on: size, row count and a content hash of the rows, to notice changed data on resume.

A data set's cursor (``datasets.Cursor``) walks rows by position, so a file rewritten at the same path (rows
reordered, edited, added) would silently feed a resumed run other rows. ``fingerprint`` reads the rows as
``sources.read_rows`` does (a JSONL file's lines as their bytes, skipping the JSON parse; a parquet file's or
a ``datasets`` directory's rows as the ``repr`` of their values, column by column through Arrow) and hashes
each row (BLAKE2b, 16 bytes); ``content`` hashes those digests in order, ``rows_unordered`` in sorted order,
which tells "the same rows in another order" from "other rows". ``size_bytes`` is the file's size (a
directory's files summed). The cost is one read of the rows and a hash of their bytes (docs/runtime.md,
"Checkpoints and resume").
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path

from restage.data.sources import missing, read_rows

DIGEST_BYTES = 16


@dataclass(frozen=True)
class Fingerprint:
    path: str
    split: str
    size_bytes: int
    rows: int
    content: str  # hex BLAKE2b of the rows' digests in file order
    rows_unordered: str  # the same over the digests sorted: equal for the same rows in any order

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Fingerprint:
        return cls(**{k: data[k] for k in ("path", "split", "size_bytes", "rows", "content", "rows_unordered")})

    def same_data(self, other: Fingerprint) -> bool:
        return (self.rows, self.content) == (other.rows, other.content)


def difference(saved: Fingerprint, now: Fingerprint) -> str:
    """How ``now`` differs from ``saved``, in words ("" when the rows are the same, whatever the file's bytes)."""
    if saved.same_data(now):
        return ""
    size = (f"{saved.size_bytes:,} bytes both" if saved.size_bytes == now.size_bytes else
            f"{saved.size_bytes:,} -> {now.size_bytes:,} bytes")
    short = f"content hash {saved.content[:12]} -> {now.content[:12]}, {size}"
    if saved.rows == now.rows and saved.rows_unordered == now.rows_unordered:
        return f"the same {now.rows:,} rows in another order ({short})"
    if saved.rows != now.rows:
        return f"{saved.rows:,} -> {now.rows:,} rows ({short})"
    return f"{now.rows:,} rows both, but not the same rows ({short})"


def _jsonl_rows(path: Path) -> tuple[str, list[bytes]]:
    """The non-blank lines of a JSONL file as bytes (what ``read_jsonl`` parses), without parsing them."""
    with path.open("rb") as f:
        return "jsonl", [line.strip() for line in f if line.strip()]


def _table_rows(path: Path, split: str) -> tuple[str, list[bytes]]:
    """A parquet file's or a ``datasets`` directory's rows as the ``repr`` of their values (the column names once,
    in the header): column by column through Arrow, several times faster than a dict and a JSON text per row."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq  # optional: the `data` extra (read_rows says how to install it)

            table = pq.read_table(path)
        except Exception:  # noqa: BLE001  # read_rows raises the one-line error for an unreadable file
            read_rows(path, split)
            raise
        names, columns = table.column_names, [table.column(n).to_pylist() for n in table.column_names]
    else:
        rows = read_rows(path, split)
        names = list(rows[0])
        columns = [[row.get(n) for row in rows] for n in names]
    return repr(names), [repr(values).encode() for values in zip(*columns)]


def _size_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def fingerprint(path: str | Path, split: str = "train") -> Fingerprint:
    """The fingerprint of the rows ``sources.read_rows(path, split)`` reads."""
    path = Path(path)
    if not path.exists():
        raise missing(path, "data file", "dataset.path")
    header, rows = _jsonl_rows(path) if path.is_file() and path.suffix != ".parquet" else _table_rows(path, split)
    digests = [hashlib.blake2b(row, digest_size=DIGEST_BYTES).digest() for row in rows]

    def digest(parts: list[bytes]) -> str:
        return hashlib.blake2b(header.encode() + b"\n" + b"".join(parts), digest_size=DIGEST_BYTES).hexdigest()

    return Fingerprint(str(path.resolve()), split, _size_bytes(path), len(rows), digest(digests),
                       digest(sorted(digests)))
