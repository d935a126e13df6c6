"""The side-by-side with the peers (experiments/side_by_side/study.py): speculators' labels, and the whole
comparison at tiny sizes (`--smoke`) on the tiny chat target, with speculators and with SpecForge's
own trainer (in its venv), so that it cannot rot."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture
def speculators():
    """Their EAGLE-3 model, imported when a test needs it (~10 s), not at collection; skipped without it, failing in
    CI."""
    from tests.peers import peer_module

    return peer_module("speculators.models.eagle3.core")


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
def test_their_initialisation_is_drawn_as_ours(tiny_target, speculators, tmp_path):
    """Their `Eagle3DraftModel` as their trainer builds it, read back by our reader, against eagle31's drafter
    as the pipeline builds it: the same target embedding and lm_head rows, norms at ones, every other
    weight N(0, 0.02) on both sides (different draws)."""
    from benchmarks.peer import speculators_drafter
    from eagle31.config import DrafterConfig
    from eagle31.convert import load_drafter
    from eagle31.model import Eagle31Drafter
    from eagle31.target import load_target_config, read_target_embeddings
    from eagle31.vocab import vocab_maps

    cfg = DrafterConfig.from_target_config(load_target_config(tiny_target), draft_vocab_size=64)
    d2t, t2d = vocab_maps(torch.arange(0, 128, 2), cfg.vocab_size)
    torch.manual_seed(0)
    speculators_drafter(cfg, d2t, t2d, attention="sdpa", ttt_length=2, verifier=str(tiny_target)).save_pretrained(
        tmp_path
    )
    theirs = load_drafter(tmp_path, source_format="speculators").state_dict()
    torch.manual_seed(0)
    ours = Eagle31Drafter(cfg)
    embed, lm_head = read_target_embeddings(tiny_target)
    ours.init_from_target(embed.float(), lm_head.float(), d2t, t2d)
    weights = {k: v for k, v in ours.state_dict().items() if k not in ("d2t", "t2d", "embed_tokens.weight")}
    assert weights.keys() <= theirs.keys()
    drawn = 0
    for name, w in weights.items():
        if name == "lm_head.weight" or w.ndim == 1:  # the target's rows; norms
            torch.testing.assert_close(theirs[name], w, rtol=0, atol=0, msg=name)
        else:
            assert not torch.equal(theirs[name], w), name
            assert abs(theirs[name].std().item() - 0.02) < 2e-3 and abs(w.std().item() - 0.02) < 2e-3, name
            assert abs(theirs[name].mean().item()) < 2e-3 and abs(w.mean().item()) < 2e-3, name
            drawn += 1
    assert drawn == 8  # fc, q, k, v, o, gate, up, down


def their_supervision(samples: list[dict], ttt_length: int) -> torch.Tensor:
    """[K, L] bool: the queries their `compute_metrics` supervises, from their own collate and alignment."""
    from speculators.models.eagle3.data import shift_batch
    from speculators.models.eagle3.metrics import align_for_step
    from speculators.train.data import CollateFn

    collated = CollateFn(64, 4, 3, dtype=torch.float32, preprocess=shift_batch)(samples)
    mask, L = collated["loss_mask"], collated["loss_mask"].shape[1]
    stub = torch.zeros(1, L, 1)  # logits and targets: only their shapes matter to the alignment
    steps = []
    for k in range(ttt_length):
        _, _, step_mask, _ = align_for_step(stub, stub, mask, None, k)
        steps.append(torch.nn.functional.pad(step_mask[0].bool(), (0, k)))  # query i of step k reads the mask at i + k
    return torch.stack(steps)


def packed_batch(lengths: list[int], prompt: int, vocab: int, hidden: int, seed: int = 0):
    """A packed `[1, T]` FeatureBatch of documents that open with `prompt` unsupervised tokens, as chats do;
    final states of unit RMS (so their `verifier_norm` with weight ones gives them back)."""
    from eagle31.data.batch import FeatureBatch

    g = torch.Generator().manual_seed(seed)
    masks = [
        torch.cat([torch.zeros(prompt), (torch.rand(n - prompt, generator=g) < 0.8).float()]).long() for n in lengths
    ]
    T = sum(lengths)
    final = torch.randn(1, T, hidden, generator=g)
    return FeatureBatch(
        input_ids=torch.randint(0, vocab, (1, T), generator=g),
        loss_mask=torch.cat(masks)[None],
        document_ids=torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None],
        aux=torch.randn(1, T, 3 * hidden, generator=g),
        final=final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True)),
    )


def test_their_loss_mask_is_one_token_early_and_eagle31_loss_mask_makes_it_ours(speculators):
    """Through their collate, `shift_batch` and `align_for_step`: their trainer's mask supervises (p, k) when
    m[p+1+k] = 1; `eagle31_loss_mask` makes their supervised queries exactly eagle31's `supervision_mask`,
    out-of-vocabulary argmax included."""
    from eagle31.loss import TargetHead, supervision_mask
    from eagle31.model import segment_ids
    from experiments.side_by_side.peer_training import eagle31_loss_mask, speculators_samples

    # each document opens with a prompt longer than K, as a chat template's opening is: their queries at a
    # document's end read the mask of the next document's first K positions, unsupervised in both
    K, lengths = 3, [9, 12, 10]
    batch, T = packed_batch(lengths, prompt=5, vocab=32, hidden=4), sum(lengths)
    head = TargetHead(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)), torch.arange(0, 32, 2))
    segments = segment_ids(batch.document_ids, None, batch.input_ids.shape)
    in_vocab = head.in_draft[head.argmax(batch.final)]
    assert not in_vocab.all() and in_vocab.any()  # the vocabulary mask matters in this batch
    # their row drops each document's first token (`shift_batch`): our query p of document d is their p - d
    ours_at = torch.cat([torch.arange(n - 1) + sum(lengths[:d]) for d, n in enumerate(lengths)])
    norm = torch.ones(4)

    def ours(in_vocab_mask):
        return supervision_mask(batch.loss_mask, segments, K, in_vocab_mask)[:, 0, ours_at]

    theirs = their_supervision(speculators_samples(batch, norm), K)[:, : ours_at.numel()]
    one_early = torch.zeros(K, 1, T, dtype=torch.bool)
    for k in range(K):
        for p in range(T - 1 - k):
            one_early[k, 0, p] = bool(batch.loss_mask[0, p + 1 + k]) and segments[0, p + 1 + k] == segments[0, p]
    assert torch.equal(theirs, one_early[:, 0, ours_at]) and not torch.equal(theirs, ours(None))
    aligned = their_supervision(speculators_samples(batch, norm, eagle31_loss_mask(batch, None)), K)[
        :, : ours_at.numel()
    ]
    assert torch.equal(aligned, ours(None))
    in_vocab_too = their_supervision(speculators_samples(batch, norm, eagle31_loss_mask(batch, head)), K)[
        :, : ours_at.numel()
    ]
    assert torch.equal(in_vocab_too, ours(in_vocab)) and not torch.equal(in_vocab_too, aligned)
    batch.loss_mask[0, lengths[0]] = 1  # the next document's first token: not a label of this one's last position
    assert not eagle31_loss_mask(batch, None)[0, lengths[0] - 1]


def test_their_drafter_trains_with_the_recipes_optimizer_and_schedule(tiny_target, speculators):
    """The peer loop builds its optimizer with eagle31.optim.build_optimizer: speculators' own default (Muon on
    their 2-D matrices, AdamW on the rest, a linear schedule) steps their drafter, its anchor refused."""
    from speculators.train.optimizers import split_named_params_for_muon

    from benchmarks.peer import speculators_drafter
    from eagle31.config import DrafterConfig
    from eagle31.errors import ConfigError
    from eagle31.target import load_target_config
    from eagle31.trainer import TrainConfig
    from eagle31.vocab import vocab_maps
    from experiments.side_by_side.peer_training import SpeculatorsTraining

    cfg = DrafterConfig.from_target_config(load_target_config(tiny_target), draft_vocab_size=64)
    Ht, d2t, t2d = cfg.target_hidden_size, *vocab_maps(torch.arange(0, 128, 2), cfg.vocab_size)
    torch.manual_seed(0)
    model = speculators_drafter(cfg, d2t, t2d, attention="sdpa", ttt_length=2)
    train = TrainConfig(ttt_length=2, optimizer="muon", schedule="linear", lr=1e-3, warmup_steps=1, max_steps=2)
    training = SpeculatorsTraining(model, train, torch.ones(Ht), max_len=128, hidden_size=Ht, num_aux=3)
    names = {id(p): n for n, p in model.named_parameters()}
    stepped = {k: {names[id(p)] for p in o.param_groups[0]["params"]} for k, o in training.optimizers.by_name.items()}
    muon, adamw = split_named_params_for_muon(model)  # their own split
    assert stepped == {"muon": {n for n, _ in muon}, "adamw": {n for n, _ in adamw}}
    assert len(stepped["muon"]) == 8 and all("norm" in n for n in stepped["adamw"])  # their lm_head is frozen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = packed_batch([40, 56], prompt=8, vocab=cfg.vocab_size, hidden=Ht)
    training.step(batch)
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n in stepped["muon"])
    assert training.optimizers.lrs() == {"lr": 1e-3, "muon_lr": 1e-3}  # after the warm-up step
    training.step(batch)
    assert training.optimizers.lrs() == {"lr": 0.0, "muon_lr": 0.0}  # linear, to 0 at max_steps
    with pytest.raises(ConfigError, match="train.anchor_weight=1.0: the speculators side starts from its own"):
        SpeculatorsTraining(model, TrainConfig(anchor_weight=1.0), torch.ones(Ht), 128, Ht, 3)


def test_their_drafter_takes_the_recipes_sliding_window(tiny_target, speculators, tmp_path):
    """drafter.sliding_window reaches their layer as their CLI's `--sliding-window` sets it: their forward
    windows its attention, and their checkpoint is read back with the window."""
    import dataclasses

    from benchmarks.peer import speculators_drafter
    from eagle31.config import DrafterConfig
    from eagle31.convert import load_drafter
    from eagle31.target import load_target_config
    from eagle31.trainer import TrainConfig
    from eagle31.vocab import vocab_maps
    from experiments.side_by_side.peer_training import SpeculatorsTraining

    cfg = DrafterConfig.from_target_config(load_target_config(tiny_target), draft_vocab_size=64)
    Ht, d2t, t2d = cfg.target_hidden_size, *vocab_maps(torch.arange(0, 128, 2), cfg.vocab_size)
    batch = packed_batch([40, 56], prompt=8, vocab=cfg.vocab_size, hidden=Ht)
    losses = {}
    for window in (None, 4):
        torch.manual_seed(0)  # the same weights
        model = speculators_drafter(
            dataclasses.replace(cfg, sliding_window=window),
            d2t,
            t2d,
            attention="sdpa",
            ttt_length=2,
            verifier=str(tiny_target),
        )
        training = SpeculatorsTraining(model, TrainConfig(ttt_length=2), torch.ones(Ht), 128, Ht, 3)
        with torch.no_grad():
            losses[window] = training.loss(batch)[0].item()
    assert model.sliding_window == 4 and model.uses_sliding_window_attn and not model.uses_full_attn
    assert losses[4] != pytest.approx(losses[None])
    model.save_pretrained(tmp_path)
    assert load_drafter(tmp_path).config.sliding_window == 4


@pytest.mark.slow
def test_on_eagle31_loss_mask_their_training_step_is_ours(tiny_target, speculators, tmp_path):
    """The same weights and packed batch: their loss under `eagle31_loss_mask` (their forward, alignment,
    per-step mean and 0.8^k weights) equals eagle31's training loss, and so do the gradients; under their
    own mask it does not. What is left between the sides is then the draw of the initial weights."""
    from benchmarks.peer import speculators_drafter
    from eagle31.config import DrafterConfig
    from eagle31.convert import load_drafter
    from eagle31.loss import TargetHead, label_positions, step_scales, supervision_mask, weighted_loss
    from eagle31.model import segment_ids
    from eagle31.target import load_target_config
    from eagle31.trainer import DrafterObjective, TrainConfig
    from eagle31.vocab import vocab_maps
    from experiments.side_by_side.peer_training import SpeculatorsTraining

    cfg = DrafterConfig.from_target_config(load_target_config(tiny_target), draft_vocab_size=64)
    V, Ht = cfg.vocab_size, cfg.target_hidden_size
    draft_ids = torch.arange(0, 128, 2)
    d2t, t2d = vocab_maps(draft_ids, V)
    torch.manual_seed(0)
    model = speculators_drafter(cfg, d2t, t2d, attention="sdpa", ttt_length=3)
    target_lm_head = torch.randn(V, Ht) * Ht**-0.5
    with torch.no_grad():  # what load_verifier_weights would read; verifier_norm at ones
        model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.copy_(target_lm_head[draft_ids])
        model.verifier_lm_head.weight.copy_(target_lm_head[draft_ids])
        model.verifier_norm.weight.fill_(1.0)
    model.save_pretrained(tmp_path)
    ours = load_drafter(tmp_path, source_format="speculators")
    ours.embed_tokens.weight.data.copy_(model.embed_tokens.weight)
    head = TargetHead(target_lm_head, draft_ids)
    train = TrainConfig(ttt_length=3, ttt_decay=0.8)
    batch = packed_batch([40, 56, 32], prompt=8, vocab=V, hidden=Ht)
    T = batch.input_ids.shape[1]

    objective = DrafterObjective(ours, train)
    segments = segment_ids(batch.document_ids, None, batch.input_ids.shape)
    argmax = head.argmax(batch.final, label_positions(batch.loss_mask))
    supervised = supervision_mask(batch.loss_mask, segments, 3, head.in_draft[argmax.clamp(min=0)] & (argmax >= 0))
    count = supervised.sum(dim=(1, 2)).double()
    stats = objective(
        batch.aux, batch.input_ids, batch.document_ids, batch.final, supervised, argmax, step_scales(count, 0.8), head
    )
    our_loss = weighted_loss(stats.loss_sum, count, 0.8)
    our_loss.backward()

    def their_loss(mask_head):
        model.zero_grad(set_to_none=True)
        training = SpeculatorsTraining(
            model, train, torch.ones(Ht), max_len=T, hidden_size=Ht, num_aux=3, mask_head=mask_head
        )
        loss, _ = training.loss(batch)
        return loss

    assert abs(their_loss(None).item() - our_loss.item()) > 1e-3  # their trainer's mask, one token early
    loss = their_loss(head)
    loss.backward()
    torch.testing.assert_close(loss.double(), our_loss.double(), rtol=1e-5, atol=1e-6)
    theirs = dict(model.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad and name != "lm_head.weight":  # their trainer freezes lm_head
            their_name = name.replace("midlayer.", "layers.0.")
            torch.testing.assert_close(theirs[their_name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow
def test_smoke_runs_both_sides_end_to_end(tiny_target, chats, tmp_path, capsys, speculators):
    from eagle31.convert import load_drafter
    from experiments.side_by_side.study import main

    out, runs = tmp_path / "out", tmp_path / "runs"
    # measure=false trains only; the next call measures what it trained
    assert (
        main(["--smoke", "measure=false", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    )
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
    steps = [
        json.loads(line)
        for line in (runs / "speculators-s0" / "drafter" / "training_steps.jsonl").read_text().splitlines()
    ]
    assert len(steps) == 2 and all(s["loss"] > 0 for s in steps)
    # a second call finds every step done and only summarises again
    assert main(["--smoke", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]) == 0
    err = capsys.readouterr().err
    assert "skip (done): speculators seed 0" in err and "kept (measured earlier, same weights): speculators-s0" in err
    assert json.loads((out / "summary.json").read_text())["acceptance"] == summary["acceptance"]


class Killed(Exception):
    pass


@pytest.mark.slow
def test_a_killed_speculators_run_resumes_to_the_same_drafter(
    tiny_target, chats, tmp_path, monkeypatch, capsys, speculators
):
    """Killed after step 3 with a checkpoint at step 2, the rerun continues from it: the same weights and step log."""
    from safetensors.torch import load_file

    from experiments.side_by_side.peer_training import SpeculatorsTraining
    from experiments.side_by_side.study import SideBySideConfig, side_recipe, train_speculators

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
    a, b = (
        load_file(next((tmp_path / run / "speculators-s0" / "drafter").glob("*.safetensors")))
        for run in ("straight", "killed")
    )
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    logs = [
        (tmp_path / run / "speculators-s0" / "drafter" / "training_steps.jsonl").read_text()
        for run in ("straight", "killed")
    ]
    assert logs[0] == logs[1] and len(logs[0].splitlines()) == 4


def test_a_bad_key_is_one_line(capsys):
    from experiments.side_by_side.study import main

    assert main(["seeds=a,b"]) == 2
    assert "seeds must be a comma-separated list of integers" in capsys.readouterr().err
    assert main(["sides=speculators,specforge"]) == 2  # no eagle31 side: nothing to compare against
    assert "sides must be eagle31 and one or more of speculators, specforge" in capsys.readouterr().err
    assert main(["device=tpu"]) == 2
    assert "device must be cpu or cuda, got 'tpu'" in capsys.readouterr().err
    assert main(["peer_mask=ours"]) == 2
    assert "peer_mask must be one of theirs, eagle31, got 'ours'" in capsys.readouterr().err


def test_specforge_refuses_what_it_cannot_train(tiny_target, chats, tmp_path, capsys):
    """SpecForge 0.2.0 feeds the pre-norm state back: an EAGLE 3.1 (norm_output) recipe is refused before any work."""
    from experiments.side_by_side.study import main

    args = ["--smoke", "sides=eagle31,specforge", f"out={tmp_path / 'out'}", f"runs={tmp_path / 'runs'}", "--"]
    assert main([*args, *tiny_overrides(tiny_target, chats)]) == 2
    assert "drafter.norm_output=true: SpecForge 0.2.0 feeds the pre-norm state back" in capsys.readouterr().err
    assert main([*args, *tiny_overrides(tiny_target, chats), "drafter.norm_output=false", "train.loss=tv"]) == 2
    assert (
        "train.loss=tv: SpecForge 0.2.0 trains EAGLE-3 with kl, lk_alpha or lk_hybrid only" in capsys.readouterr().err
    )
    assert (
        main([args[0], "device=cuda", *args[1:], *tiny_overrides(tiny_target, chats), "drafter.norm_output=false"]) == 2
    )
    assert "device=cuda: the SpecForge side trains in its CPU venv" in capsys.readouterr().err
    for lever, why in [
        ("train.optimizer=muon", "SpecForge 0.2.0's optimizer is AdamW"),
        ("train.schedule=linear", "SpecForge 0.2.0 runs its own warm-up + cosine schedule"),
    ]:
        assert main([*args, *tiny_overrides(tiny_target, chats), "drafter.norm_output=false", lever]) == 2
        assert f"{lever}: {why}" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_smoke_runs_specforge_side_end_to_end(tiny_target, chats, tmp_path, capsys):
    """SpecForge's own trainer (its venv) for 2 steps on our features; its HF export read back by our reader."""
    from safetensors.torch import load_file

    from tests.peers import specforge_python

    specforge_python()  # skipped without its venv, failing under CI=true

    from eagle31.convert import load_drafter
    from experiments.side_by_side.study import main

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


def test_the_gpu_side_by_side_runs_the_environment_and_its_part_alone(tmp_path, monkeypatch):
    from benchmarks import gpu_check
    from experiments.side_by_side import gpu

    ran = []
    monkeypatch.setattr(
        gpu_check,
        "run_part",
        lambda part, out, smoke, timeout: ran.append((part.name, part.kind, timeout)) or {"status": "pass"},
    )
    assert gpu.main([str(tmp_path / "check")]) == 0
    assert ran == [
        ("environment", "environment", 60),
        ("side by side", "experiments.side_by_side.gpu:side_by_side", gpu.SIDE_BY_SIDE.budget_s),
    ]
    assert gpu.SIDE_BY_SIDE.budget_s < gpu.BUDGET_S < 600  # one command of a lent machine
    assert json.loads((tmp_path / "check" / "summary.json").read_text())["mode"] == "gpu side by side"
    assert gpu.main([]) == 2


@pytest.mark.slow
def test_the_gpu_side_by_side_smoke_trains_both_sides_and_measures_them(tmp_path, speculators):
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "check"
    cmd = [sys.executable, "-m", "experiments.side_by_side.gpu", "--cpu-smoke", str(out)]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    side = json.loads((out / "summary.json").read_text())["parts"][
        "side by side"
    ]  # both trainers, then one measurement
    assert side["status"] == "pass", side
    assert (
        set(side["training"]) == {"eagle31-s0", "speculators-s0"} and side["acceptance"][0]["ratio"]["speculators"] > 0
    )
    assert (out / "side_by_side" / "result" / "results.md").is_file()
