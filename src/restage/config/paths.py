"""Where a config's relative paths point: one rule for plan, run, submit and sweeps.

A relative path written in a config file is relative to **that file's directory** (as a sweep's
``base:`` always was); one given on the command line (``models.actor.path=ckpt``) is relative to the
working directory it was typed in; a sweep's ``overrides``, ``grid`` and ``zip`` values are relative to
the sweep file's directory. ``run.results_dir`` left out is ``results`` beside the config file. The
loader makes every such path absolute, so the trial's ``config.yaml`` and every error name the file
itself, and a job runs the same from any directory. The keys that hold paths: ``models.<name>.path``,
``dataset.path``, ``dataset.tokenizer``, ``dataset.eval_path``, ``run.results_dir``, and
``cluster.name`` / ``slurm.template`` when they name a file (``*.yaml`` / ``*.sh``) rather than a
shipped one. A value that is not a local path, a hub id such as ``Qwen/Qwen3-0.6B``, is made absolute
too and refused where it is read, with the hub hint (``errors.hub_hint``).
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_RESULTS_DIR = "results"  # config.RunConfig.results_dir's default, placed beside the config file


def path_keys(data: dict) -> list[tuple[dict, str]]:
    """(the mapping, the key) of every path a raw config mapping holds, wherever it is set."""
    out: list[tuple[dict, str]] = []
    models = data.get("models")
    if isinstance(models, dict):
        out += [(spec, "path") for spec in models.values() if isinstance(spec, dict)]
    for section, keys, suffixes in (("dataset", ("path", "tokenizer", "eval_path"), ()),
                                    ("run", ("results_dir",), ()), ("cluster", ("name",), (".yaml", ".yml")),
                                    ("slurm", ("template",), (".sh",))):
        mapping = data.get(section)
        if isinstance(mapping, dict):
            out += [(mapping, key) for key in keys
                    if not suffixes or str(mapping.get(key, "")).endswith(suffixes)]
    return out


def absolute(value, base: Path):
    """``value`` made absolute against ``base`` where it is a relative path ('' and non-strings kept)."""
    if not isinstance(value, str) or not value or os.path.isabs(os.path.expanduser(value)):
        return os.path.expanduser(value) if isinstance(value, str) else value
    return os.path.normpath(base / value)


def resolve_paths(data: dict, base: Path) -> None:
    """Make every relative path of the raw config mapping ``data`` absolute against ``base``, in place."""
    for mapping, key in path_keys(data):
        if key in mapping:
            mapping[key] = absolute(mapping[key], base)


def resolve_file_paths(data: dict, config_file: Path) -> None:
    """The rule for a config file's own values: against its directory; a left-out results_dir too."""
    base = config_file.resolve().parent
    run = data.setdefault("run", {})
    if isinstance(run, dict) and "results_dir" not in run:
        run["results_dir"] = DEFAULT_RESULTS_DIR
    resolve_paths(data, base)


def absolute_override(override: str, base: Path) -> str:
    """``key=value`` with a relative path value made absolute against ``base`` (the trial records its overrides
    so, and a resume from another directory finds the same files); any other override as it is."""
    key, sep, value = override.partition("=")
    parts = key.strip().split(".")
    data: dict = {}
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    for mapping, name in path_keys(data):
        if mapping.get(name) == value and value:
            return f"{key}{sep}{absolute(value, base)}"
    return override
