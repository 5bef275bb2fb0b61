"""User-facing errors. Each message says what to change; the CLI prints it on one line and exits 2."""

import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RestageError(Exception):
    """Base of every error a user can cause (bad config, paths, layouts, memory)."""


class ConfigError(RestageError):
    """The experiment config is malformed or inconsistent."""


class CheckpointError(RestageError):
    """A checkpoint directory is missing, malformed or of an unsupported architecture."""


class LayoutError(RestageError):
    """A layout does not fit the model or the world (tp vs heads, pp vs layers, ranks outside the world)."""


class PlanError(RestageError):
    """No execution plan fits (memory, device count)."""


class LaunchError(RestageError):
    """Starting ranks locally or on SLURM failed for a reason the user can fix."""


class RankFailure(RestageError):
    """A rank raised or died; the message names the rank and its error."""


class LogError(RestageError):
    """A run log (log.h5) is missing, unreadable, of another format version, or would be overwritten."""


class DiskFullError(RestageError):
    """A write ran out of space (or quota); the message names the file system and what was being written."""


class RewardError(RestageError):
    """A rule reward raised or returned a non-finite value and ``rewards.on_error`` is stop."""


def hub_hint(path) -> str:
    """For a path that does not exist: a hint when it looks like a HF hub id, else ''."""
    text = str(path)
    owner, _, name = text.partition("/")
    # owner/name, where no local directory "owner" exists and the name is not a data file's
    if _HUB_ID.match(text) and not os.path.exists(owner) and not name.endswith((".jsonl", ".json", ".parquet")):
        return (f"; {text!r} looks like a HF hub id, but restage loads only local directories: fetch it where there "
                f"is network (`huggingface-cli download {text} --local-dir DIR`, or for a data set "
                f"`datasets.load_dataset({text!r}).save_to_disk(DIR)`), copy DIR here and give its path")
    return ""
