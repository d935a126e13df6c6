"""The failures a user can cause or meet, each with its own exit code.

Every expected failure is an `Eagle31Error` whose message is one line naming the
file, field or value at fault; the command-line tools (`eagle31.cli`) print that
line and exit with the class's `exit_code`. The classes are below, except
`TrainingDiverged` (1, `eagle31.trainer`). docs/reliability.md tables the codes for users,
and tests/test_docs.py holds that table to these classes.

Kept free of torch so that any module may import it.
"""

from __future__ import annotations

import json
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

Choice = TypeVar("Choice", bound=StrEnum)


def choose(kind: type[Choice], value: Any, name: str) -> Choice:
    """`value` as a member of `kind`: the guard of library functions that take a choice outside a recipe."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{name} must be one of {[m.value for m in kind]}, got {value!r}") from None


class Eagle31Error(Exception):
    """An expected failure: one line for the user, and the exit code that says which kind it is."""

    exit_code = 1


class InputError(Eagle31Error, ValueError):
    """A configuration value or an input the run cannot use."""

    exit_code = 2


class ConfigError(InputError):
    """A drafter or run configuration is invalid; the message names the field."""


class CorruptDataError(Eagle31Error):
    """Data on disk (a store's shard or manifest, an imported capture) fails its checks."""

    exit_code = 3


class CorruptCheckpointError(Eagle31Error):
    """No checkpoint of the run passes its checksums."""

    exit_code = 4


class FileAccessError(Eagle31Error):
    """A file or directory cannot be read or written."""

    exit_code = 5


class DiskFullError(Eagle31Error):
    """Writing failed for lack of space; the message says what was kept."""

    exit_code = 6


class OutputInUseError(Eagle31Error):
    """Another live process holds the output directory's lock."""

    exit_code = 7


class RankLost(Eagle31Error):
    """A rank of the run died (or its node was lost); the last complete checkpoint is kept."""

    exit_code = 8


class EngineError(Eagle31Error):
    """The inference engine of `features.mode=engine` cannot go on: a worker's own error, a worker that does not
    compute what the recipe asks, or one dead more often than `features.engine.max_restarts`."""

    exit_code = 9


class RunPreempted(Eagle31Error):
    """SIGTERM / SIGUSR1 (a scheduler's preemption): every rank stopped after writing a complete checkpoint.

    128 + SIGTERM, the code a scheduler expects from a job it terminated.
    """

    exit_code = 143


class StoppedAtOnce(Eagle31Error):
    """A second stop signal, or the grace running out: the process left at once, the last complete checkpoint kept.

    128 + SIGKILL, as if the scheduler had killed it.
    """

    exit_code = 137


class RunInterrupted(Eagle31Error):
    """The user pressed Ctrl-C; the message says where the run can resume."""

    exit_code = 130


def report_to_launcher(message: str) -> None:
    """Under torchrun, write `message` as this rank's error file (the format of torch's `@record`).

    torchrun's agent ends its failure report with the root cause's `py_callstack`;
    without an error file it would print a pointer to the docs there instead.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))}}}
    try:
        Path(path).write_text(json.dumps(data))
    except OSError:
        pass  # the line is on stderr already
