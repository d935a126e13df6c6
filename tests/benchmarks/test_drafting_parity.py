"""benchmarks/drafting_parity.py: its files, its fp64 rows at rounding, and its bad arguments."""

import json

from benchmarks.drafting_parity import main


def test_the_benchmark_writes_its_result_and_table(tmp_path):
    out = tmp_path / "parity.json"
    assert main(["lengths=8,20", "seeds=1", "depth=2", f"out={out}"]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["n"], r["dtype"]) for r in runs] == [(8, "float32"), (8, "float64"), (20, "float32"), (20, "float64")]
    assert all(
        max(r["max_abs_difference_by_depth"]) < 1e-10 * r["largest_logit"] for r in runs if r["dtype"] == "float64"
    )
    assert "| 20 | float64 |" in out.with_suffix(".md").read_text()


def test_the_benchmark_reports_the_spread_over_the_seeds_and_the_command(tmp_path):
    out = tmp_path / "parity.json"
    assert main(["lengths=8", "seeds=3", "depth=2", f"out={out}"]) == 0
    fp32 = json.loads(out.read_text())["runs"][0]
    by_seed = fp32["max_abs_difference_by_seed"]
    assert len(by_seed) == 3 and fp32["max_abs_difference_by_depth"] == [max(gaps) for gaps in zip(*by_seed)]
    table = out.with_suffix(".md").read_text()
    assert "python -m benchmarks.drafting_parity lengths=8 seeds=3 depth=2" in table
    depth_2 = [gaps[1] for gaps in by_seed]
    assert f"| 8 | float32 | {min(gaps[0] for gaps in by_seed):.1e} – " in table
    assert f" – {max(depth_2):.1e} | {fp32['largest_logit']:.1f} |" in table and f"| {min(depth_2):.1e} – " in table
    assert f"| 8 | 2 | {by_seed[2][0]:.1e} | {by_seed[2][1]:.1e} |" in table
    assert "the weight draw alone moves one gap" in table


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["seeds=0"]) == 2
    assert main(["lengths=a"]) == 2
    assert capsys.readouterr().err.count("error: ") == 2
