"""experiments/loss_comparison/study.py: eagle31 drafters that differ only in train.loss, trained on the
same data and measured together; end to end at tiny sizes (`--smoke`) on the tiny chat target."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.experiments.test_side_by_side import tiny_overrides


@pytest.mark.slow
def test_smoke_trains_each_loss_and_compares_it_with_the_baseline(tiny_target, chats, tmp_path, capsys):
    import yaml

    from experiments.loss_comparison.study import main

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
    assert hybrid["separation"] is None  # one seed a side has no spread to lie outside of
    assert "loss" not in summary["settings"]["recipe"]["train"]  # the key that differs is per run
    assert "| lk_hybrid |" in (out / "results.md").read_text()
    assert "python -m experiments.loss_comparison --smoke" in (out / "commands.sh").read_text()

    # a later session: one run is gone, one loss is new; only the new one trains and is measured
    shutil.rmtree(runs / "eagle31-lk_hybrid-s0")
    capsys.readouterr()
    assert main(["--smoke", "losses=kl,lk_hybrid,tv", f"out={out}", f"runs={runs}", *overrides]) == 0
    err = capsys.readouterr().err
    assert "kept (measured earlier, same weights): eagle31-s0" in err
    assert "kept (measured earlier, its run is not here): eagle31-lk_hybrid-s0" in err
    later = json.loads((out / "summary.json").read_text())
    (later_row,) = later["acceptance"]
    assert later_row["losses"]["kl"]["tau"] == kl["tau"] and later_row["losses"]["lk_hybrid"]["tau"] == hybrid["tau"]
    assert later_row["losses"]["tv"]["mean"] >= 1.0 and later["training"]["eagle31-tv-s0"]["steps"] == 2
    assert later["training"]["eagle31-lk_hybrid-s0"] == {**summary["training"]["eagle31-lk_hybrid-s0"], "earlier": True}
    report = json.loads((out / "acceptance" / "acceptance.json").read_text())
    assert report["settings"]["kept"] == ["eagle31-lk_hybrid-s0"] and len(report["settings"]["drafter_sha256"]) == 3
    assert "| eagle31-lk_hybrid-s0 * |" in (out / "results.md").read_text()


def test_separation_needs_every_seed_on_one_side():
    from experiments.harness import separation

    def seeds(*taus):
        return {"tau": list(taus), "min": min(taus), "max": max(taus)}

    baseline = seeds(1.5, 1.7)
    assert separation(seeds(1.71, 1.9), baseline) == "higher"
    assert separation(seeds(1.2, 1.49), baseline) == "lower"
    assert separation(seeds(1.6, 1.9), baseline) is None  # the spreads overlap
    assert separation(seeds(1.9), seeds(1.5)) is None  # one seed a side: no spread to be outside of
    assert separation(seeds(1.9, 2.0), seeds(1.5)) is None


def test_bad_keys_are_one_line(capsys):
    from experiments.loss_comparison.study import main

    assert main(["losses=kl,focal"]) == 2
    assert "losses must be two or more distinct train.loss values" in capsys.readouterr().err
    assert main(["losses=kl"]) == 2  # nothing to compare with
    assert main(["seeds=x"]) == 2
    assert "seeds must be a comma-separated list of integers" in capsys.readouterr().err


def report(drafters: dict[str, str], sha256: dict[str, str] | None = None, k: int = 3) -> dict:
    settings = {"target": "t", "drafters": drafters, "data": {"heldout": "h.jsonl"}, "k": k}
    if sha256 is not None:
        settings["drafter_sha256"] = sha256
    rows = [
        {"drafter": label, "split": "heldout", "tau": 1.5, "prompt_tokens": 10, "generated_tokens": 20}
        for label in drafters
    ]
    return {"settings": settings, "results": rows}


def test_an_earlier_measurement_is_kept_only_for_the_same_settings_and_weights():
    from experiments.harness import kept_measurements

    earlier = report({"a": "ra", "b": "rb", "c": "rc"}, sha256={"a": "1", "b": "2", "c": "3"})
    now = report({"a": "ra", "b": "rb", "c": "rc", "d": "rd"})["settings"]
    # a: same weights; b: retrained; c: its run is gone; d: never measured
    assert kept_measurements(earlier, now, {"a": "1", "b": "9", "d": "4"}) == {"a", "c"}
    assert kept_measurements(earlier, report({"a": "ra"}, k=5)["settings"], {"a": "1"}) == set()  # other settings
    assert kept_measurements(None, now, {}) == set()
    legacy = report({"a": "ra", "c": "rc"})  # recorded no sha256: a drafter still here is measured again
    assert kept_measurements(legacy, now, {"a": "1"}) == {"c"}


def test_the_settings_an_earlier_measurement_differs_in_are_named():
    from experiments.harness import settings_differ

    now = report({"a": "ra"})
    assert settings_differ(report({"b": "rb"}, sha256={"b": "2"}), now["settings"]) == []  # drafters do not count
    assert settings_differ(report({"a": "ra"}, k=5), now["settings"]) == ["k"]
    older = report({"a": "ra"})  # a report from before a setting was recorded
    assert settings_differ(older, {**now["settings"], "verification": "replay"}) == ["verification"]


def test_drafters_verified_against_different_target_decodings_are_refused(tmp_path):
    from eagle31.errors import ConfigError
    from experiments.harness import check_one_target_decoding

    mixed = report({"a": "ra", "b": "rb"})
    check_one_target_decoding(mixed, tmp_path / "acceptance.json")
    mixed["results"][1]["generated_tokens"] = 21
    with pytest.raises(ConfigError, match="split heldout: the drafters saw different target decodings"):
        check_one_target_decoding(mixed, tmp_path / "acceptance.json")


def test_a_drafter_fingerprint_follows_its_files(tmp_path):
    from experiments.harness import drafter_sha256

    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "config.json").write_text("{}")
    first = drafter_sha256(tmp_path)
    assert drafter_sha256(tmp_path) == first
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    assert drafter_sha256(tmp_path) != first
