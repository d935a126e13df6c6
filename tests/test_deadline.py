"""tests/deadline.py: a test that runs past its deadline fails there, with every thread's stack, instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.deadline(120)  # waits on a pytest process
def test_a_test_past_its_deadline_fails_in_time_and_shows_where_it_waited(tmp_path):
    (tmp_path / "test_waits.py").write_text(
        "import subprocess, pytest\n\n@pytest.mark.deadline(1)\ndef test_waits():\n"
        "    subprocess.run(['sleep', '60'])  # another process that does not answer\n"
    )
    start = time.monotonic()
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.deadline"]
    done = subprocess.run(
        [*pytest_run, "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path / "test_waits.py")],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_ADDOPTS": ""},  # none of the outer run's options
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert time.monotonic() - start < 30  # not the 60 s of the wait
    assert done.returncode == 1 and "test_waits.py::test_waits ran past its deadline of 1 s" in done.stdout, done.stdout
    assert "line 5 in test_waits" in done.stdout  # the stack of the waiting test, in its report
