"""benchmarks/memory_model.py: the estimate term by term against two real steps of a tiny drafter (fresh processes)."""

import json

import pytest

from benchmarks import memory_model
from benchmarks.memory_model import SHAPES, compare, main


@pytest.mark.slow
@pytest.mark.parametrize("shape", list(SHAPES["tiny"]))
def test_each_term_of_the_estimate_holds_at_a_tiny_shape(shape):
    """MLA, and a parallel drafter (its mask_hidden and mask slots): every term within 1% of two real steps."""
    result = compare(shape, SHAPES["tiny"][shape])
    failed = [k for k, ok in result["checks"].items() if not ok]
    assert not failed, (failed, [p["estimate_over_measured"] for p in result["points"]])
    point = result["points"][0]["raw"]
    assert point["gradient_bytes"] == point["trainable_bytes"]  # every trainable parameter got its gradient
    assert point["persistent_bytes"] >= 2 * point["trainable_bytes"]  # AdamW's two moments stay


def test_recorded_measurements_are_compared_again_without_running(tmp_path, monkeypatch):
    made_up = {
        "trainable_bytes": 1000,
        "gradient_bytes": 1000,
        "persistent_bytes": 2000,
        "frozen_embedding_bytes": 10,
        "target_lm_head_bytes": 10,
        "target_features_bytes": 10,
    }
    earlier = {"shapes": []}
    for name, spec in SHAPES["tiny"].items():
        points = [{"seq_len": T, "raw": {**made_up, "step_peak_bytes": 5000 + T}} for T in spec["seq_lens"]]
        earlier["shapes"].append({"shape": name, "points": points})
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    monkeypatch.setattr(
        memory_model, "measure_point", lambda *a: (_ for _ in ()).throw(AssertionError("measured again"))
    )
    out = tmp_path / "again.json"
    assert main(["size=tiny", f"measured={path}", f"out={out}"]) == 1  # made-up bytes: the checks fail
    again = json.loads(out.read_text())
    assert again["shapes"][0]["points"][0]["raw"]["step_peak_bytes"] == 5128
    assert (tmp_path / "again.md").read_text().startswith("| shape |")


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["size=huge"]) == 2 and main(["bogus"]) == 2
    assert capsys.readouterr().err.count("\n") == 2


@pytest.mark.slow
def test_the_committed_measurements_hold_against_the_estimate_as_it_is(monkeypatch, capsys):
    """The committed run's measurements against today's estimate (nothing is measured again): every term, every
    total and every checked per-token slope within 1% (the traced step is the measured step's code). A change to
    `eagle31.estimate` that breaks one fails here until the benchmark is run again and still passes."""
    from pathlib import Path

    committed = Path(memory_model.ROOT) / "benchmarks" / "results" / "memory_model.json"
    monkeypatch.setattr(
        memory_model, "measure_point", lambda *a: (_ for _ in ()).throw(AssertionError("measured again"))
    )
    assert main([f"measured={committed}", "out=none"]) == 0, capsys.readouterr().err
    slopes = [line for line in capsys.readouterr().out.splitlines() if "| slope |" in line]
    assert len(slopes) == len(SHAPES["full"])  # one per shape, from more than two T where checked
    assert all(len(spec["seq_lens"]) >= 3 for spec in SHAPES["full"].values() if spec.get("slope_checked", True))
