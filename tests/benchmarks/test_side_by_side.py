"""The side-by-side with the peers (benchmarks/side_by_side.py): speculators' labels, and the whole
comparison at tiny sizes (`--smoke`) on the tiny chat target, with speculators and with SpecForge's
own trainer (in its venv), so that it cannot rot."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def speculators():
    """Their EAGLE-3 model, imported when a test needs it (~10 s), not at collection."""
    return pytest.importorskip("speculators.models.eagle3.core")


def tiny_overrides(target, chats) -> list[str]:
    """The tiny chat target and its conversations, in a CPU-sized recipe with a Llama drafter."""
    return [
        "recipe=kimi_k26_mini",
        "target.builtin=null",
        f"target.path={target}",
        "target.name=tiny",
        f"data.source=[{chats}]",
        "data.max_len=64",
        "data.eval_fraction=0.1",
        "drafter.draft_vocab_size=128",
        "drafter.attention=llama",
        "features.tokens_per_batch=256",
        "train.lr=3e-3",
        "train.warmup_steps=1",
        f"eval.data=[{chats}]",
    ]


@pytest.mark.slow
def test_speculators_labels_from_our_store_equal_ours(tiny_target, speculators):
    """Their labels verifier_lm_head(verifier_norm(final / norm.weight)) are the target's draft-vocabulary logits."""
    from benchmarks.peer import speculators_drafter
    from eagle31.config import DrafterConfig
    from eagle31.data.speculators_import import final_norm_weight
    from eagle31.target import load_target_config, read_target_embeddings
    from eagle31.vocab import vocab_maps

    cfg = DrafterConfig.from_target_config(load_target_config(tiny_target), draft_vocab_size=64)
    draft_ids = torch.arange(0, 128, 2)
    d2t, t2d = vocab_maps(draft_ids, cfg.vocab_size)
    model = speculators_drafter(cfg, d2t, t2d, attention="sdpa", ttt_length=2, verifier=str(tiny_target))
    _, lm_head = read_target_embeddings(tiny_target)
    norm = final_norm_weight(tiny_target).float()
    pre = torch.randn(20, cfg.target_hidden_size) * 3  # the target's last hidden state, before its norm
    final = norm * pre * torch.rsqrt(pre.pow(2).mean(-1, keepdim=True) + 1e-5)  # what our store keeps
    with torch.no_grad():
        theirs = model.verifier_lm_head(model.verifier_norm(final / norm))
    ours = final @ lm_head.float()[draft_ids].T
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert not model.lm_head.weight.requires_grad  # their trainer's default, kept unless peer_lm_head=true


@pytest.mark.slow
def test_smoke_runs_both_sides_end_to_end(tiny_target, chats, tmp_path, capsys, speculators):
    from benchmarks.side_by_side import main
    from eagle31.convert import load_drafter

    out, runs = tmp_path / "out", tmp_path / "runs"
    # measure=false trains only; the next call measures what it trained
    assert main(["--smoke", "measure=false", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    assert all((runs / f"{side}-s0" / "report.json").is_file() for side in ("eagle31", "speculators"))
    assert not (out / "summary.json").exists() and not (out / "acceptance").exists()
    assert main(["--smoke", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    assert "skip (done): speculators seed 0" in capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["acceptance"]  # one eval split
    for side in ("eagle31", "speculators"):
        assert len(row[side]["tau"]) == 1 and row[side]["mean"] >= 1.0
        assert summary["training"][f"{side}-s0"]["steps"] == 2
    assert row["ratio"] == {"speculators": pytest.approx(row["eagle31"]["mean"] / row["speculators"]["mean"])}
    assert "eagle31 / speculators" in (out / "results.md").read_text()
    assert "side_by_side --smoke" in (out / "commands.sh").read_text()
    # speculators' own checkpoint, read back by our reader as the speculators layout; it trained
    peer = load_drafter(runs / "speculators-s0" / "drafter")
    from safetensors.torch import load_file

    saved = load_file(next((runs / "speculators-s0" / "drafter").glob("*.safetensors")))
    torch.testing.assert_close(peer.fc.weight, saved["fc.weight"].to(peer.fc.weight.dtype))
    steps = [json.loads(line) for line in (runs / "speculators-s0" / "drafter" / "training_steps.jsonl").read_text().splitlines()]
    assert len(steps) == 2 and all(s["loss"] > 0 for s in steps)
    # a second call finds every step done and only summarises again
    assert main(["--smoke", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    err = capsys.readouterr().err
    assert "skip (done): speculators seed 0" in err and "kept (measured earlier, same weights): speculators-s0" in err
    assert json.loads((out / "summary.json").read_text())["acceptance"] == summary["acceptance"]


class Killed(Exception):
    pass


@pytest.mark.slow
def test_a_killed_speculators_run_resumes_to_the_same_drafter(tiny_target, chats, tmp_path, monkeypatch, capsys):
    """Killed after step 3 with a checkpoint at step 2, the rerun continues from it: the same weights and step log."""
    from safetensors.torch import load_file

    from benchmarks.peer_training import SpeculatorsTraining
    from benchmarks.side_by_side import SideBySideConfig, side_recipe, train_speculators

    overrides = [*tiny_overrides(tiny_target, chats), "train.save_every=2"]

    def recipe(runs):
        return side_recipe(SideBySideConfig(runs=str(runs), seeds="0", max_steps=4), overrides, 0, "speculators")

    assert recipe(tmp_path).resume == "auto"  # eagle31's side resumes through the pipeline
    straight = train_speculators(recipe(tmp_path / "straight"), peer_lm_head=False)
    real_step, calls = SpeculatorsTraining.step, []

    def dies_at_step_4(self, batch):
        if len(calls) == 3:
            raise Killed
        calls.append(batch)
        return real_step(self, batch)

    monkeypatch.setattr(SpeculatorsTraining, "step", dies_at_step_4)
    with pytest.raises(Killed):
        train_speculators(recipe(tmp_path / "killed"), peer_lm_head=False)
    monkeypatch.undo()
    assert not (tmp_path / "killed" / "speculators-s0" / "report.json").exists()
    resumed = train_speculators(recipe(tmp_path / "killed"), peer_lm_head=False)
    assert "resume: speculators seed 0 from step 2" in capsys.readouterr().err
    assert resumed["steps"] == straight["steps"] == 4 and resumed["tokens_seen"] == straight["tokens_seen"]
    a, b = (load_file(next((tmp_path / run / "speculators-s0" / "drafter").glob("*.safetensors"))) for run in ("straight", "killed"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    logs = [(tmp_path / run / "speculators-s0" / "drafter" / "training_steps.jsonl").read_text() for run in ("straight", "killed")]
    assert logs[0] == logs[1] and len(logs[0].splitlines()) == 4


def test_a_bad_key_is_one_line(capsys):
    from benchmarks.side_by_side import main

    assert main(["seeds=a,b"]) == 2
    assert "seeds must be a comma-separated list of integers" in capsys.readouterr().err
    assert main(["sides=speculators,specforge"]) == 2  # no eagle31 side: nothing to compare against
    assert "sides must be eagle31 and one or more of speculators, specforge" in capsys.readouterr().err


def test_specforge_refuses_what_it_cannot_train(tiny_target, chats, tmp_path, capsys):
    """SpecForge 0.2.0 feeds the pre-norm state back: an EAGLE 3.1 (norm_output) recipe is refused before any work."""
    from benchmarks.side_by_side import main

    args = ["--smoke", "sides=eagle31,specforge", f"out={tmp_path / 'out'}", f"runs={tmp_path / 'runs'}", "--"]
    assert main([*args, *tiny_overrides(tiny_target, chats)]) == 2
    assert "drafter.norm_output=true: SpecForge 0.2.0 feeds the pre-norm state back" in capsys.readouterr().err
    assert main([*args, *tiny_overrides(tiny_target, chats), "drafter.norm_output=false", "train.loss=tv"]) == 2
    assert "train.loss=tv: SpecForge 0.2.0 trains EAGLE-3 with kl, lk_alpha or lk_hybrid only" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_smoke_runs_specforge_side_end_to_end(tiny_target, chats, tmp_path, capsys):
    """SpecForge's own trainer (its venv) for 2 steps on our features; its HF export read back by our reader."""
    from safetensors.torch import load_file

    from tests.peers import specforge_python

    specforge_python()  # skipped without its venv, failing under CI=true

    from benchmarks.side_by_side import main
    from eagle31.convert import load_drafter

    out, runs = tmp_path / "out", tmp_path / "runs"
    overrides = [*tiny_overrides(tiny_target, chats), "drafter.norm_output=false"]
    assert main(["--smoke", "sides=eagle31,specforge", f"out={out}", f"runs={runs}", "--", *overrides]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["acceptance"]
    assert set(row) >= {"eagle31", "specforge"} and "speculators" not in row
    assert row["ratio"] == {"specforge": pytest.approx(row["eagle31"]["mean"] / row["specforge"]["mean"])}
    assert "eagle31 / specforge" in (out / "results.md").read_text()
    report = summary["training"]["specforge-s0"]
    assert report["steps"] == 2 and report["tokens_seen"] > 0 and report["documents_per_step"] >= 1
    run = runs / "specforge-s0"
    # their offline files: one per document of our train split, every document once
    features = json.loads((run / "specforge" / "features.json").read_text())
    assert len(list((run / "specforge" / "features").glob("*.ckpt"))) == len(features["lengths"])
    # their step log: 2 optimizer steps with a finite loss and their per-step accuracies
    steps = [json.loads(line) for line in (run / "drafter" / "training_steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(0 < s["loss"] < 100 and "acc_1" in s for s in steps)
    # their export, read by our SpecForge reader: pre-norm feedback, their aux ids + 1, our vocabulary
    with pytest.warns(UserWarning, match="SpecForge drafter with norm_output=true"):
        peer = load_drafter(run / "drafter")
    ours = load_drafter(runs / "eagle31-s0" / "drafter")
    assert not peer.config.norm_output and peer.config.fc_norm
    assert peer.config.aux_layer_ids == ours.config.aux_layer_ids
    torch.testing.assert_close(peer.d2t, ours.d2t, rtol=0, atol=0)
    saved = load_file(run / "drafter" / "model.safetensors")
    torch.testing.assert_close(peer.fc.weight, saved["fc.weight"].to(peer.fc.weight.dtype))
    # a second call finds every step done and only summarises again
    assert main(["--smoke", "sides=eagle31,specforge", f"out={out}", f"runs={runs}", "--", *overrides]) == 0
    assert "skip (done): specforge seed 0" in capsys.readouterr().err
