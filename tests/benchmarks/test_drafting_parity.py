"""benchmarks/drafting_parity.py: its files, its fp64 rows at rounding, and its bad arguments."""

import json

from benchmarks.drafting_parity import main


def test_the_benchmark_writes_its_result_and_table(tmp_path):
    out = tmp_path / "parity.json"
    assert main(["lengths=8,20", "seeds=1", "depth=2", f"out={out}"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["n"], r["dtype"]) for r in runs] == [(8, "float32"), (8, "float64"), (20, "float32"), (20, "float64")]
    assert all(max(r["max_abs_difference_by_depth"]) < 1e-10 * r["largest_logit"] for r in runs if r["dtype"] == "float64")
    assert "| 20 | float64 |" in out.with_suffix(".md").read_text()


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["seeds=0"]) == 2
    assert main(["lengths=a"]) == 2
    assert capsys.readouterr().err.count("error: ") == 2
