"""A user's data files as rows: JSONL, parquet and local HF ``datasets`` directories, with field names mapped.

``read_rows(path, split)`` returns one dict per example whatever the format:

* ``*.jsonl`` / ``*.json`` lines: one JSON object per line (``read_jsonl``'s errors);
* ``*.parquet``: read with ``pyarrow`` (the ``data`` extra);
* a directory written by ``datasets``' ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose
  ``split`` is taken), read with ``datasets.load_from_disk`` (the ``data`` extra). Only local directories
  load: a path that does not exist but looks like a hub id (``Qwen/Qwen2-0.5B``) gets a hint to fetch it.

``select_roles(rows, kind, fields, where)`` picks each role the layout needs (``prompt``; ``answer``;
``chosen``, ``rejected``) from the column ``fields`` names for it (the role's own name by default). A
role's value is text, a list of chat messages (``{"role", "content"}``, for ``dataset.chat_template``),
or token ids (a list of ints: pre-tokenised). A row without a ``prompt`` column may give its prompt
ids as ``input_ids`` or ``token_ids``. Every other column is kept, under its own name, for the reward
function (``Example.fields``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from restage.config.choices import DatasetKind, check_choice
from restage.errors import ConfigError, hub_hint

ROLES: dict[DatasetKind, tuple[str, ...]] = {DatasetKind.PROMPT: ("prompt",), DatasetKind.SFT: ("prompt", "answer"),
                                             DatasetKind.PREFERENCE: ("prompt", "chosen", "rejected")}
PRETOKENISED = ("input_ids", "token_ids")  # columns that may hold a prompt's ids when it has no prompt column


def missing(path: str | Path, what: str, key: str) -> ConfigError:
    """The one-line error for a path that does not exist, with the hub hint when it applies."""
    return ConfigError(f"{what} {path} does not exist; set {key}{hub_hint(path)}")


def read_rows(path: str | Path, split: str = "train") -> list[dict]:
    """The rows of a JSONL file, a parquet file or a ``save_to_disk`` directory (``split`` of a DatasetDict)."""
    path = Path(path)
    if not path.exists():
        raise missing(path, "data file", "dataset.path (make the shipped one with `python -m restage.data.make`)")
    if path.is_dir():
        rows = _read_hf_directory(path, split)
    elif path.suffix == ".parquet":
        rows = _read_parquet(path)
    else:
        rows = read_jsonl(path, ())
    if not rows:
        raise ConfigError(f"data file {path} holds no rows")
    return rows


def read_jsonl(path: str | Path, fields: Sequence[str]) -> list[dict]:
    """Rows of a JSONL file; every row must be an object with string ``fields``. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data file {path} does not exist; set dataset.path (make the shipped one with "
                          "`python -m restage.data.make`)")
    rows = []
    offset_bytes = 0  # of the line's start in the file
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{path}:{number}: not UTF-8 (byte {offset_bytes + err.start} of the file, "
                                  f"0x{raw[err.start]:02x}); save the file as UTF-8") from None
            offset_bytes += len(raw)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{number}: expected a JSON object with fields {', '.join(fields)}")
            for name in fields:
                if name not in row:
                    raise ConfigError(f"{path}:{number}: missing field {name!r} (this layout needs {', '.join(fields)})")
                if not isinstance(row[name], str):
                    raise ConfigError(f"{path}:{number}: field {name!r} must be a string, got {type(row[name]).__name__}")
            rows.append(row)
    if not rows:
        raise ConfigError(f"data file {path} holds no rows")
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq  # optional: the `data` extra
    except ImportError:
        raise ConfigError(f"{path}: reading parquet needs pyarrow; pip install 'restage[data]'") from None
    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise ConfigError(f"{path}: not a readable parquet file ({str(err).splitlines()[0]})") from None


def _read_hf_directory(path: Path, split: str) -> list[dict]:
    try:
        import datasets  # optional: the `data` extra
    except ImportError:
        raise ConfigError(f"{path}: reading a HF datasets directory needs datasets; pip install 'restage[data]'") from None
    datasets.disable_progress_bars()
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{path}: not a directory written by datasets' save_to_disk ({str(err).splitlines()[0]}); "
                          "give a .jsonl or .parquet file or such a directory") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError(f"{path}: no split {split!r}; it has {', '.join(loaded)} (set dataset.split)")
        loaded = loaded[split]
    return loaded.to_list()


def column_for(role: str, fields: Mapping[str, str]) -> str:
    return fields.get(role, role)


def select_roles(rows: Sequence[dict], kind: DatasetKind | str, fields: Mapping[str, str], where: str) -> list[dict]:
    """Each row as ``{role: value for the layout's roles} | {other column: value}``; one-line errors name the
    row and the columns the file has."""
    layout: DatasetKind = check_choice(kind, DatasetKind, "dataset.kind")
    unknown = sorted(set(fields) - {*ROLES[DatasetKind.PREFERENCE], *ROLES[DatasetKind.SFT]})
    if unknown:
        raise ConfigError(f"dataset.fields: {', '.join(unknown)} is not a role; map prompt, answer, chosen or rejected")
    out = []
    for number, row in enumerate(rows, 1):
        picked: dict = {}
        used = set()
        for role in ROLES[layout]:
            column = column_for(role, fields)
            if column not in row and role == "prompt" and "prompt" not in fields:
                column = next((c for c in PRETOKENISED if c in row), column)
            if column not in row:
                mapped = f" (dataset.fields.{role})" if role in fields else ""
                raise ConfigError(f"{where}:{number}: missing field {column!r}{mapped} for the {role}; the rows have "
                                  f"{', '.join(map(repr, row))}: map one with dataset.fields.{role}=NAME")
            picked[role] = check_value(row[column], f"{where}:{number}: field {column!r}")
            used.add(column)
        out.append(picked | {"fields": {k: v for k, v in row.items() if k not in used}})
    return out


def check_value(value, where: str):
    """Text, chat messages or token ids, as read; anything else is refused in one line."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    if isinstance(value, (list, tuple)) and value and all(_is_message(m) for m in value):
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise ConfigError(f"{where} must be text, chat messages ([{{role, content}}, ...]) or token ids (a list of ints), "
                      f"got {json.dumps(value, default=str)[:60]}")


def _is_message(value) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("role"), str) and isinstance(value.get("content"), str)
