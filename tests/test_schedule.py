"""tests/schedule.py: the longest test files first; `--record-durations` keeps the list."""

import json
from types import SimpleNamespace

from tests import schedule


def test_files_run_longest_first_each_in_its_own_order_and_an_unlisted_one_between(tmp_path, monkeypatch):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"tests/a.py": 1.0, "tests/b.py": 300.0, "tests/c.py": 20.0}))
    monkeypatch.setattr(schedule, "DURATIONS", durations)
    names = ["tests/a.py::x", "tests/a.py::y", "tests/new.py::z", "tests/c.py::x", "tests/b.py::y", "tests/b.py::x"]
    items = [SimpleNamespace(nodeid=n) for n in names]
    schedule.pytest_collection_modifyitems(None, None, items)
    assert [i.nodeid for i in items] == [
        "tests/b.py::y",
        "tests/b.py::x",
        "tests/c.py::x",
        "tests/new.py::z",  # UNLISTED_S: after the long files, before the quick ones
        "tests/a.py::x",
        "tests/a.py::y",
    ]


def test_a_passing_run_records_the_files_it_ran_and_keeps_the_others(tmp_path, monkeypatch):
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"tests/a.py": 1.0, "tests/b.py": 300.0}))
    monkeypatch.setattr(schedule, "DURATIONS", durations)
    recorder = schedule.DurationRecorder()
    for nodeid, seconds in (("tests/a.py::x", 2.0), ("tests/a.py::x", 0.5), ("tests/c.py::y", 40.0)):
        recorder.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds, failed=False))
    recorder.pytest_sessionfinish(None, 0)
    assert list(json.loads(durations.read_text()).items()) == [
        ("tests/b.py", 300.0),
        ("tests/c.py", 40.0),
        ("tests/a.py", 2.5),  # setup, call and teardown
    ]
    recorder.pytest_runtest_logreport(SimpleNamespace(nodeid="tests/b.py::z", duration=1.0, failed=True))
    recorder.pytest_sessionfinish(None, 1)
    assert json.loads(durations.read_text())["tests/b.py"] == 300.0  # a failing run records nothing
