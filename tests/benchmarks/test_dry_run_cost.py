"""benchmarks/dry_run_cost.py: the dry run's traces of a split sequence, every block and two of each shape."""

import json

import pytest

from benchmarks.dry_run_cost import main


@pytest.mark.slow
def test_the_demo_drafter_split_in_two_is_traced_both_ways_to_the_same_bytes(tmp_path):
    out = tmp_path / "dry_run_cost.json"
    assert main([f"out={out}", "recipes=demo", "split=2"]) == 0  # 1: the bytes differ
    (row,) = json.loads(out.read_text())["rows"]
    assert row["recipe"] == "demo" and row["split"] == 2 and row["every_block_s"] > 0 and row["steady_s"] > 0
    assert "| demo | 2 |" in out.with_suffix(".md").read_text()
