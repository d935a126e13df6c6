"""The side-by-side with speculators (benchmarks/side_by_side.py): its labels, and the whole
comparison at tiny sizes (`--smoke`) on the tiny chat target, so that it cannot rot."""

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
    assert main(["--smoke", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["acceptance"]  # one eval split
    for side in ("eagle31", "speculators"):
        assert len(row[side]["tau"]) == 1 and row[side]["mean"] >= 1.0
        assert summary["training"][f"{side}-s0"]["steps"] == 2
    assert row["ratio"] == pytest.approx(row["eagle31"]["mean"] / row["speculators"]["mean"])
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
    assert "skip (done): speculators seed 0" in capsys.readouterr().err


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
