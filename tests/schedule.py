"""The longest test files first, so that the suite's two workers end together.

Under `--dist=loadfile` a file runs on one worker, and the workers take files in the order they were collected
(`--no-loadscope-reorder`; pytest-xdist's own order puts the files with the most tests first, which leaves a file
holding one long end-to-end test for last, on one worker while the other idles). `pytest_collection_modifyitems`
sorts the files by their seconds in `tests/durations.json`, longest first (a file it does not list counts as
`UNLISTED_S`), keeping each file's own order; `--record-durations` writes there the seconds of the files a passing
run ran (every test of them: run whole files), keeping the others'.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
UNLISTED_S = 5.0  # a new file: after the long ones, before the quick ones


def pytest_addoption(parser):
    parser.addoption(
        "--record-durations",
        action="store_true",
        help="write the seconds (setup, call and teardown) of each test file run to tests/durations.json",
    )


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session, config, items):
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(file_of(item.nodeid), UNLISTED_S))  # stable: a file keeps its order


class DurationRecorder:
    """Sums the reports' durations per file; on the controller under xdist it sees every worker's."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.failed = False

    def pytest_runtest_logreport(self, report):
        self.seconds[file_of(report.nodeid)] += report.duration
        self.failed |= report.failed

    def pytest_sessionfinish(self, session, exitstatus):
        if self.failed or not self.seconds:
            return  # a failing run's times are not the suite's
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        seconds.update((f, round(s, 1)) for f, s in self.seconds.items())
        DURATIONS.write_text(json.dumps(dict(sorted(seconds.items(), key=lambda fs: -fs[1])), indent=1) + "\n")


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if config.getoption("--record-durations") and not hasattr(config, "workerinput"):  # the controller only
        config.pluginmanager.register(DurationRecorder(), "eagle31-duration-recorder")
