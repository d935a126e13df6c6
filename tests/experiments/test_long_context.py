"""experiments/long_context/study.py: EAGLE 3 and 3.1, full attention and a window, trained on the same data and
measured together; end to end at tiny sizes (`--smoke`) on the tiny chat target, and its summary by hand."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.experiments.test_side_by_side import tiny_overrides


@pytest.mark.slow
def test_smoke_trains_each_variant_with_and_without_a_window_and_compares_them(tiny_target, chats, tmp_path, capsys):
    import torch

    from eagle31.convert import load_drafter
    from experiments.long_context.study import main

    out, runs = tmp_path / "out", tmp_path / "runs"
    assert main(["--smoke", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    for name, window, fc_norm in (("eagle31-w4-s0", 4, True), ("eagle3-full-s0", None, False)):
        config = yaml.safe_load((runs / name / "config.yaml").read_text())
        assert config["drafter"]["sliding_window"] == window and config["drafter"]["fc_norm"] == fc_norm
        assert json.loads((runs / name / "drafter" / "config.json").read_text())["drafter"]["sliding_window"] == window
    summary = json.loads((out / "summary.json").read_text())
    assert {(r["variant"], r["window"]) for r in summary["acceptance"]} == {
        ("eagle3", None),
        ("eagle3", 4),
        ("eagle31", None),
        ("eagle31", 4),
    }
    assert all(r["of_first_split"] == pytest.approx(1.0) for r in summary["acceptance"])  # one split: its own
    assert "| EAGLE 3.1 | 4 |" in (out / "results.md").read_text()
    # the runs of a variant differ in the window alone (one seed, data, order): trained with the window ignored, its
    # drafter would come out bit for bit the drafter trained with full attention
    for variant in ("eagle31", "eagle3"):
        windowed, full = (load_drafter(runs / f"{variant}-{w}-s0" / "drafter").state_dict() for w in ("w4", "full"))
        assert windowed.keys() == full.keys()
        assert any(not torch.equal(windowed[name], full[name]) for name in full), (
            f"{variant}: the window changed nothing"
        )
    assert "experiments.long_context --smoke" in (out / "commands.sh").read_text()


def test_the_summary_compares_each_split_with_the_first_and_3_1_with_3_under_the_same_window(monkeypatch):
    from experiments.long_context import study

    cfg = study.LongContextConfig(seeds="0,1", windows="none,128")
    taus = {
        ("heldout", "eagle3", "full"): (2.6, 2.7),
        ("heldout", "eagle31", "full"): (2.8, 2.9),
        ("heldout", "eagle3", "w128"): (2.5, 2.6),
        ("heldout", "eagle31", "w128"): (2.7, 2.8),
        ("long", "eagle3", "full"): (1.6, 1.7),
        ("long", "eagle31", "full"): (1.4, 1.5),
        ("long", "eagle3", "w128"): (2.3, 2.4),
        ("long", "eagle31", "w128"): (2.5, 2.6),
    }
    results = [
        {"drafter": f"{v}-{w}-s{s}", "split": split, "tau": t[s]} for (split, v, w), t in taus.items() for s in (0, 1)
    ]
    monkeypatch.setattr(
        study, "shared_settings", lambda recipe: {"drafter": {"sliding_window": None}, "train": {}, "data": {}}
    )
    monkeypatch.setattr(study, "training_reports", lambda runs, out: {})
    summary = study.summarize(cfg, {"results": results}, None)
    row = {(r["split"], r["variant"], r["window"]): r for r in summary["acceptance"]}
    assert row[("long", "eagle31", 128)]["of_first_split"] == pytest.approx(2.55 / 2.75)
    assert (
        row[("long", "eagle31", 128)]["separation"] == "higher"
        and row[("long", "eagle31", None)]["separation"] == "lower"
    )
    assert (
        row[("heldout", "eagle31", None)]["vs_eagle3"] == pytest.approx(0.2)
        and "vs_eagle3" not in row[("long", "eagle3", 128)]
    )
    assert "sliding_window" not in summary["settings"]["recipe"]["drafter"]  # per run


def test_bad_keys_are_one_line(capsys):
    from experiments.long_context.study import main

    assert main(["windows=none,zero"]) == 2
    assert "windows must list `none` or positive position counts" in capsys.readouterr().err
    assert main(["variants=eagle2"]) == 2
    assert main(["windows=128,128"]) == 2


def test_train_turns_must_be_positive(capsys):
    from experiments.long_context.study import main

    assert main(["train_turns=0"]) == 2
    assert "train_turns must be a positive integer, got 0" in capsys.readouterr().err
