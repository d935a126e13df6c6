"""The command-line plumbing: one line and a distinct exit code per failure kind, torchrun's report, quoting hints."""

from __future__ import annotations

import errno
import re
from pathlib import Path

import pytest

from eagle31.data.store import CorruptShardError
from eagle31.errors import (
    ConfigError,
    CorruptCheckpointError,
    OutputInUseError,
    RankLost,
    RunInterrupted,
    RunPreempted,
    StoppedAtOnce,
)
from eagle31.io import ForeignDirectoryError
from eagle31.trainer import TrainingDiverged
from eagle31_cli import recipe_main, run_cli

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def raising(e: BaseException):
    def body():
        raise e

    return body


@pytest.mark.parametrize(
    "error, code",
    [
        (TrainingDiverged("5 non-finite steps"), 1),
        (ConfigError("train.lr must be positive"), 2),
        (ForeignDirectoryError("/p holds files that eagle31 did not write"), 2),
        (CorruptShardError("corrupt shard /s/shard-000000.safetensors"), 3),
        (CorruptCheckpointError("no intact checkpoint"), 4),
        (PermissionError(errno.EACCES, "Permission denied", "/ro/run"), 5),
        (OSError(errno.ENOSPC, "No space left on device", "/full/x"), 6),
        (OutputInUseError("held by pid 1"), 7),
        (RankLost("rank 1 (pid 7 on n1) has died"), 8),
        (KeyboardInterrupt(), 130),
        (RunInterrupted("interrupted at step 3"), 130),
        (StoppedAtOnce("a second SIGTERM"), 137),
        (RunPreempted("stopped by SIGTERM at step 3"), 143),
    ],
)
def test_every_expected_failure_is_one_line_with_its_own_exit_code(error, code, capsys):
    assert run_cli(raising(error)) == code
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    if isinstance(error, OSError):
        assert error.filename in err


def test_an_unexpected_exception_is_not_hidden():
    with pytest.raises(ZeroDivisionError):
        run_cli(raising(ZeroDivisionError("a bug")))


def test_under_torchrun_the_users_line_closes_the_launchers_report(tmp_path, monkeypatch, capsys):
    """torch's own agent classes read the error file and format the report that torchrun prints last."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    files = {}
    for rank in (0, 1):
        files[rank] = tmp_path / f"error_{rank}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(files[rank]))
        assert run_cli(raising(ConfigError(f"train.lr must be positive, got -1 (rank {rank})"))) == 2
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=2, error_file=str(f)) for r, f in files.items()}
    report = ChildFailedError("train/main.py", failures).format_msg()
    lines = [x for x in report.strip().splitlines() if not set(x) <= {"="}]
    assert "error: train.lr must be positive, got -1" in lines[-1]
    assert "To enable traceback" not in report


def test_a_path_with_parentheses_gets_a_quoting_hint_that_works(tmp_path, capsys):
    source = tmp_path / "my chats (1).jsonl"
    assert recipe_main(lambda cfg: None, RECIPES, [f"data.source=[{source}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    hinted = re.search(r"'(data\.source=.*)'\)$", err).group(1)
    seen = []
    assert recipe_main(lambda cfg: seen.append(list(cfg.data.source)), RECIPES, [hinted]) == 0
    assert seen == [[str(source)]]
