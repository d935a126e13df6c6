"""experiments/learning_curve/study.py: one training per (variant, budget), MT-Bench replay of the points not
measured yet, the curve; end to end at tiny sizes (`--smoke`) on the tiny chat target."""

from __future__ import annotations

import json

import pytest

from tests.experiments.test_side_by_side import tiny_overrides


def write_questions(path):
    rows = [
        {"question_id": i, "category": c, "turns": [f"What is {i} plus 2?", "And times 3?"]}
        for i, c in enumerate(["math", "writing"])
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_smoke_trains_measures_and_skips_what_is_done(tiny_target, chats, tmp_path, capsys):
    from experiments.learning_curve.study import main

    out, runs = tmp_path / "out", tmp_path / "runs"
    keys = ["--smoke", f"out={out}", f"runs={runs}", f"questions={write_questions(tmp_path / 'q.jsonl')}", "threads=1"]
    overrides = ["--", *tiny_overrides(tiny_target, chats)]
    assert main([*keys, *overrides]) == 0
    curve = json.loads((out / "curve.json").read_text())
    assert [(p["variant"], p["steps"]) for p in curve["points"]] == [("eagle3", 2), ("eagle31", 2)]
    for p in curve["points"]:
        assert set(p["tau"]) == {"chain-k2", "tree-2x2-3"} and all(t >= 1.0 for t in p["tau"].values())
        assert p["tokens_seen"] > 0 and p["epochs"] == pytest.approx(p["tokens_seen"] / curve["train_tokens"])
    # the variants are the two drafters: EAGLE 3 without 3.1's switches
    from eagle31.convert import load_drafter

    eagle3, eagle31 = (load_drafter(runs / f"{v}-s0-steps2" / "drafter").config for v in ("eagle3", "eagle31"))
    assert (eagle3.fc_norm, eagle3.norm_output, eagle31.fc_norm, eagle31.norm_output) == (False, False, True, True)
    assert "| eagle31 | 2 |" in (out / "curve.md").read_text() and (out / "curve.png").stat().st_size > 0
    capsys.readouterr()

    # a larger budget added later: only its points train and are measured
    small = ["ks=2", "tree_top_k=2", "tree_depth=2", "tree_total_tokens=3", "max_per_category=1", "max_new_tokens=8"]
    assert main([*keys[1:], *small, "budgets=2,3", *overrides]) == 0
    err = capsys.readouterr().err
    assert "skip (trained): eagle3-s0-steps2" in err and "train: eagle3-s0-steps3" in err
    assert "eagle31-s0-steps2 / chain-k2" not in err and "eagle31-s0-steps3 / chain-k2" in err  # measured once
    curve = json.loads((out / "curve.json").read_text())
    assert [p["steps"] for p in curve["points"]] == [2, 3, 2, 3]
    assert "python -m experiments.learning_curve --smoke" in (out / "commands.sh").read_text()


def test_bad_keys_are_one_line(capsys):
    from experiments.learning_curve.study import main

    assert main(["budgets=10,x"]) == 2
    assert "budgets must be a comma-separated list of step counts" in capsys.readouterr().err
    assert main(["variants=eagle4"]) == 2
    assert "variants: eagle4; known: eagle3, eagle31" in capsys.readouterr().err
