"""The expected failures, each a one-line message and an exit code (docs/reliability.md); free of torch."""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import suppress
from enum import StrEnum
from pathlib import Path
from typing import Any, NoReturn, TypeVar

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
    """The engine of `features.mode=engine` cannot go on (a worker's error, wrong features, too many deaths)."""

    exit_code = 9


class RunPreempted(Eagle31Error):
    """SIGTERM / SIGUSR1 (a scheduler's preemption): every rank stopped after writing a complete checkpoint."""

    exit_code = 143  # 128 + SIGTERM, what a scheduler expects of a job it terminated


class StoppedAtOnce(Eagle31Error):
    """A second stop signal, or the grace running out: the process left at once, the last complete checkpoint kept."""

    exit_code = 137  # 128 + SIGKILL, as if the scheduler had killed it


class RunInterrupted(Eagle31Error):
    """The user pressed Ctrl-C; the message says where the run can resume."""

    exit_code = 130


def report_to_launcher(message: str) -> None:
    """Under torchrun, `message` as this rank's error file (`@record`'s format): the root cause the agent reports."""
    if path := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        info = {"py_callstack": message, "timestamp": str(int(time.time()))}
        with suppress(OSError):  # the line is on stderr already
            Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))


def exit_now(line: str, code: int) -> NoReturn:
    """`line` on stderr and in torchrun's error file, then exit with `code` without unwinding."""
    print(line, file=sys.stderr, flush=True)
    report_to_launcher(line)
    os._exit(code)
