"""metrics.jsonl on resume: lines after the checkpoint and a line torn by a kill are dropped."""

import json

import pytest

from eagle31.errors import CorruptDataError
from eagle31.metrics_log import truncate_metrics


def write_lines(path, steps, torn: str = ""):
    path.write_text("".join(json.dumps({"step": s, "train/loss": 1.0 / s}) + "\n" for s in steps) + torn)


def test_a_torn_last_line_is_dropped_with_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [1, 2, 3, 4], torn='{"step": 5, "train/lo')  # SIGKILL in the middle of a write
    assert truncate_metrics(path, 2) == 3
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]


def test_the_evaluation_of_a_checkpoint_saved_before_it_is_dropped_with_the_later_steps(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 2, "eval/loss": 1.0},
        {"step": 4, "train/loss": 0.5},
        {"step": 4, "eval/loss": 0.9},
        {"step": 5, "train/loss": 0.4},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert truncate_metrics(path, 4, evaluated=False) == 2  # the resumed run evaluates step 4 again
    assert [json.loads(x) for x in path.read_text().splitlines()] == lines[:2]


def test_a_broken_line_before_the_last_is_named(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(CorruptDataError, match=r"metrics.jsonl:2 "):
        truncate_metrics(path, 2)


def test_no_file_is_nothing_to_do(tmp_path):
    assert truncate_metrics(tmp_path / "metrics.jsonl", 0) == 0
