"""benchmarks/loss_comparison.py: eagle31 drafters that differ only in train.loss, trained on the
same data and measured together; end to end at tiny sizes (`--smoke`) on the tiny chat target."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.test_side_by_side import tiny_overrides


@pytest.mark.slow
def test_smoke_trains_each_loss_and_compares_it_with_the_baseline(tiny_target, chats, tmp_path, capsys):
    import yaml

    from benchmarks.loss_comparison import main

    out, runs = tmp_path / "out", tmp_path / "runs"
    keys = ["--smoke", "losses=kl,lk_hybrid", f"out={out}", f"runs={runs}"]
    overrides = ["--", *tiny_overrides(tiny_target, chats)]
    assert main([*keys, "measure=false", *overrides]) == 0  # trains only
    assert not (out / "summary.json").exists()
    # the baseline is named as the side-by-side's eagle31 run; each run trained with its own loss
    for name, loss in (("eagle31-s0", "kl"), ("eagle31-lk_hybrid-s0", "lk_hybrid")):
        assert json.loads((runs / name / "report.json").read_text())["steps"] == 2
        assert yaml.safe_load((runs / name / "config.yaml").read_text())["train"]["loss"] == loss
    capsys.readouterr()

    assert main([*keys, *overrides]) == 0
    assert "skip (done): eagle31-lk_hybrid-s0" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["acceptance"]  # one eval split
    kl, hybrid = row["losses"]["kl"], row["losses"]["lk_hybrid"]
    assert kl["ratio"] == 1.0 and kl["separation"] is None
    assert hybrid["ratio"] == pytest.approx(hybrid["mean"] / kl["mean"]) and hybrid["mean"] >= 1.0
    expected = "higher" if hybrid["min"] > kl["max"] else "lower" if hybrid["max"] < kl["min"] else None
    assert hybrid["separation"] == expected
    assert "loss" not in summary["settings"]["recipe"]["train"]  # the key that differs is per run
    assert "| lk_hybrid |" in (out / "results.md").read_text()
    assert "benchmarks.loss_comparison --smoke" in (out / "commands.sh").read_text()


def test_separation_needs_every_seed_on_one_side():
    from benchmarks.loss_comparison import separation

    baseline = {"min": 1.5, "max": 1.7}
    assert separation({"min": 1.71, "max": 1.9}, baseline) == "higher"
    assert separation({"min": 1.2, "max": 1.49}, baseline) == "lower"
    assert separation({"min": 1.6, "max": 1.9}, baseline) is None  # the spreads overlap


def test_bad_keys_are_one_line(capsys):
    from benchmarks.loss_comparison import main

    assert main(["losses=kl,focal"]) == 2
    assert "losses must be two or more distinct train.loss values" in capsys.readouterr().err
    assert main(["losses=kl"]) == 2  # nothing to compare with
    assert main(["seeds=x"]) == 2
    assert "seeds must be a comma-separated list of integers" in capsys.readouterr().err
