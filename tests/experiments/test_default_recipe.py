"""experiments/default_recipe/study.py: eagle31's default recipe against speculators' default recipe on the same
data and training tokens, and eagle31's levers; the recipes each side composes, and the whole study at tiny sizes
(`--smoke`) on the tiny chat target."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.experiments.test_side_by_side import tiny_overrides


def test_the_speculators_side_carries_their_defaults_on_the_same_budget(tmp_path):
    """speculators 0.9.0's defaults layered on the demo recipe; eagle31's side and each lever keep the recipe but
    for the lever's key; every run the same steps of the same batches from the same data and store."""
    from experiments.default_recipe.study import DefaultRecipeConfig, recipe_differences, run_recipes

    cfg = DefaultRecipeConfig(runs=str(tmp_path), seeds="0,1", max_steps=150, levers="optimizer=muon,loss=lk_alpha")
    recipes = run_recipes(cfg, ["recipe=demo"])
    assert list(recipes)[:4] == [
        "eagle31-s0",
        "speculators-s0",
        "eagle31-optimizer-muon-s0",
        "eagle31-loss-lk_alpha-s0",
    ]
    ours, theirs = recipes["eagle31-s0"], recipes["speculators-s0"]
    assert (ours.train.optimizer, ours.train.schedule, ours.train.lr) == ("adamw", "cosine", 3e-3)  # the demo's
    t = theirs.train
    assert (t.optimizer, t.schedule, t.lr, t.weight_decay, list(t.betas)) == (
        "muon",
        "linear",
        1e-3,
        0.01,
        [0.9, 0.999],
    )
    assert (t.muon_lr, t.muon_momentum, t.muon_weight_decay, t.muon_ns_steps) == (None, 0.95, 0.1, 5)
    assert (t.max_grad_norm, t.loss, t.ttt_length, t.ttt_decay) == (1.0, "kl", 3, 1.0)
    assert t.warmup_steps == 1  # 1% of the steps
    d = theirs.drafter
    assert (d.sliding_window, d.norm_before_fc, d.fc_norm, d.norm_before_residual, d.norm_output) == (
        2048,
        True,
        False,
        True,
        True,
    )
    for recipe in recipes.values():  # the same training tokens from the same data and store
        assert recipe.train.max_steps == 150 and recipe.features.tokens_per_batch == ours.features.tokens_per_batch
        assert (recipe.data.prepared_dir, recipe.features.store_dir) == (f"{tmp_path}/data", f"{tmp_path}/features")
        assert recipe.drafter.draft_vocab_size == ours.drafter.draft_vocab_size
    assert recipes["speculators-s1"].seed == 1 and recipes["eagle31-loss-lk_alpha-s1"].seed == 1
    # a lever on the data or the draft vocabulary prepares its own, on the same budget
    own = run_recipes(
        DefaultRecipeConfig(runs=str(tmp_path), seeds="0,1", max_steps=150, levers="drafter.draft_vocab_size=512"),
        ["recipe=demo"],
    )
    for seed in (0, 1):
        vocab = own[f"eagle31-drafter.draft_vocab_size-512-s{seed}"]
        assert (vocab.data.prepared_dir, vocab.features.store_dir) == (
            f"{tmp_path}/data-drafter.draft_vocab_size-512/data",
            f"{tmp_path}/data-drafter.draft_vocab_size-512/features",
        )
        assert (vocab.drafter.draft_vocab_size, vocab.train.max_steps) == (512, 150)
        assert vocab.output_dir == f"{tmp_path}/eagle31-drafter.draft_vocab_size-512-s{seed}"
    assert own["eagle31-s0"].data.prepared_dir == f"{tmp_path}/data"
    # a lever of several keys (`+` before a key), trained as one run; a `+` inside a value stays in it
    levers = "drafter.init_from=published/drafter+anchor_weight=0.01,lr=1e+3+data.max_len=256"
    both = DefaultRecipeConfig(runs=str(tmp_path), seeds="0", max_steps=150, levers=levers)
    assert both.lever_overrides == {
        "drafter.init_from-published-drafter+anchor_weight-0.01": "drafter.init_from=published/drafter"
        "+train.anchor_weight=0.01",
        "lr-1e-3+data.max_len-256": "train.lr=1e+3+data.max_len=256",
    }
    both_recipes = run_recipes(both, ["recipe=demo"])
    anchored = both_recipes["eagle31-drafter.init_from-published-drafter+anchor_weight-0.01-s0"]
    assert (anchored.drafter.init_from, anchored.train.anchor_weight) == ("published/drafter", 0.01)
    assert anchored.data.prepared_dir == f"{tmp_path}/data-drafter.init_from-published-drafter+anchor_weight-0.01/data"
    shorter = both_recipes["eagle31-lr-1e-3+data.max_len-256-s0"]
    assert (shorter.train.lr, shorter.data.max_len) == (1e3, 256)
    assert shorter.data.prepared_dir == f"{tmp_path}/data-lr-1e-3+data.max_len-256/data"
    assert recipe_differences(ours, recipes["eagle31-optimizer-muon-s0"]) == {"train.optimizer": ["adamw", "muon"]}
    # peer_switches=eagle31: the drafters differ in the window only; no max_steps: the recipe's (demo: 300)
    same = run_recipes(DefaultRecipeConfig(runs=str(tmp_path), seeds="0", peer_switches="eagle31"), ["recipe=demo"])
    drafter_keys = {
        k for k in recipe_differences(same["eagle31-s0"], same["speculators-s0"]) if k.startswith("drafter.")
    }
    assert drafter_keys == {"drafter.sliding_window"}
    assert same["speculators-s0"].train.warmup_steps == 3
    # no eval.data: refused where the drafters are measured on it, not for the MT-Bench probes or training alone
    from eagle31.errors import ConfigError
    from experiments.side_by_side.study import check_recipe

    bare = run_recipes(DefaultRecipeConfig(runs=str(tmp_path), seeds="0"), ["recipe=demo", "eval.data=[]"])
    with pytest.raises(ConfigError, match="eval.data names no prompt file"):
        check_recipe(bare["speculators-s0"], ["eagle31", "speculators"])
    check_recipe(bare["speculators-s0"], ["eagle31", "speculators"], prompts=False)


def test_bad_keys_are_one_line(capsys):
    from experiments.default_recipe.study import main

    assert main(["levers=optimizer"]) == 2
    assert "levers: 'optimizer' is not key=value" in capsys.readouterr().err
    assert main(["levers=features.tokens_per_batch=512"]) == 2
    assert "levers: features.tokens_per_batch is what every run shares" in capsys.readouterr().err
    assert main(["levers=lr=1e-3+eval.k=3"]) == 2
    assert "levers: eval.k is what every run shares" in capsys.readouterr().err
    assert main(["levers=lr=1e-3,lr=1e-3"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["peer_switches=mine"]) == 2
    assert "peer_switches must be one of theirs, eagle31, got 'mine'" in capsys.readouterr().err
    assert main(["probes=mt_bench,vicuna"]) == 2
    assert "probes: 'vicuna' is not one of mt_bench, unseen_system, long_history" in capsys.readouterr().err
    assert main(["probes=mt_bench", "tree=8,5"]) == 2
    assert "tree must be three positive integers top_k,depth,total_tokens, got '8,5'" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_runs_both_defaults_and_a_lever_end_to_end(tiny_target, chats, tmp_path, capsys):
    from eagle31.convert import load_drafter
    from experiments.default_recipe.study import main
    from experiments.harness import separation
    from tests.peers import peer_module

    peer_module("speculators")
    out, runs = tmp_path / "out", tmp_path / "runs"
    keys = ["--smoke", "levers=optimizer=muon,drafter.draft_vocab_size=64", f"out={out}", f"runs={runs}"]
    recipe = ["--", *tiny_overrides(tiny_target, chats)]
    assert main([*keys, *recipe]) == 0
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["acceptance"]  # one eval split
    for side in ("eagle31", "speculators"):
        assert len(row[side]["tau"]) == 1 and row[side]["mean"] >= 1.0
    assert row["ratio"] == {"speculators": pytest.approx(row["eagle31"]["mean"] / row["speculators"]["mean"])}
    assert row["separation"] == {"speculators": separation(row["eagle31"], row["speculators"])}
    (levers,) = summary["levers"]
    muon = levers["levers"]["optimizer-muon"]
    assert muon["ratio"] == pytest.approx(muon["mean"] / levers["default"]["mean"])
    assert levers["default"] == {k: row["eagle31"][k] for k in ("tau", "mean", "min", "max")}
    training = summary["training"]
    vocab = "eagle31-drafter.draft_vocab_size-64"
    assert set(training) == {"eagle31-s0", "speculators-s0", "eagle31-optimizer-muon-s0", f"{vocab}-s0"}
    assert {t["steps"] for t in training.values()} == {2}
    assert len({t["tokens_seen"] for t in training.values()}) == 1  # the same training tokens
    assert summary["budget"]["tokens_seen"] == training["eagle31-s0"]["tokens_seen"] and summary["budget"]["epochs"]
    assert summary["settings"]["speculators"]["train.optimizer"] == ["adamw", "muon"]
    results = (out / "results.md").read_text()
    for line in (
        "| train.optimizer | adamw | muon |",
        "| eagle31 / speculators | outside the spread of speculators |",
        "| train.optimizer=muon |",
    ):
        assert line in results
    # speculators' own checkpoint, read back with their window and switches
    theirs = load_drafter(runs / "speculators-s0" / "drafter").config
    assert (theirs.sliding_window, theirs.norm_before_fc, theirs.fc_norm) == (2048, True, False)
    assert "python -m experiments.default_recipe --smoke" in (out / "commands.sh").read_text()
    # the vocabulary lever trained on data of its own: its prepared split and its draft vocabulary
    assert load_drafter(runs / f"{vocab}-s0" / "drafter").config.draft_vocab_size == 64
    assert (runs / "data-drafter.draft_vocab_size-64" / "data" / "report.json").is_file()
    assert load_drafter(runs / "eagle31-s0" / "drafter").config.draft_vocab_size == 128

    # the same drafters on the MT-Bench probes: one report per probe, a split per probe and mode
    from experiments.default_recipe.study import UNSEEN_SYSTEM
    from tests.eval.test_mtbench import write_questions

    questions = write_questions(tmp_path / "question.jsonl")
    probes = ["probes=mt_bench,unseen_system,long_history", f"questions={questions}", "max_per_category=1"]
    probes += ["ks=2,3", "tree=2,2,3", "history_tokens=24"]
    assert main([*keys, *probes, *recipe]) == 0
    summary = json.loads((out / "summary.json").read_text())
    splits = [row["split"] for row in summary["acceptance"]]
    modes = ["chain-k2", "chain-k3", "tree-2x2-3"]
    assert splits == [f"{probe} {mode}" for probe in ("mt_bench", "unseen_system", "long_history") for mode in modes]
    assert [row["split"] for row in summary["levers"]] == splits
    for probe in ("mt_bench", "unseen_system", "long_history"):
        report = json.loads((out / probe / "mt_bench.json").read_text())
        assert {r["drafter"] for r in report["results"]} == set(training)
        assert report["settings"]["questions_used"] == 2  # one per category
        assert report["settings"]["system_prompt"] == (UNSEEN_SYSTEM if probe == "unseen_system" else None)
        assert (report["settings"]["history"] is not None) == (probe == "long_history")
        for row in summary["acceptance"]:
            if row["split"].startswith(probe):
                mode = row["split"].split()[1]
                ours = next(
                    r for r in report["results"] if (r["drafter"], r["mode"], r["split"]) == ("eagle31-s0", mode, "all")
                )
                assert row["eagle31"]["tau"] == [ours["tau"]]
    assert "MT-Bench (the first 1 of each category questions" in (out / "results.md").read_text()
    # measured once: a second run keeps every probe's report
    stamps = {p: (out / p / "mt_bench.json").stat().st_mtime_ns for p in ("mt_bench", "unseen_system")}
    capsys.readouterr()
    assert main([*keys, *probes, *recipe]) == 0
    assert "kept (measured earlier): MT-Bench, unseen_system" in capsys.readouterr().err
    assert stamps == {p: (out / p / "mt_bench.json").stat().st_mtime_ns for p in stamps}

    # another seed, in a later session that no longer holds seed 0's speculators run and names one lever: that run
    # is neither trained nor measured again; each probe measures the new seed's drafters and joins them to its
    # earlier report, which keeps the other lever's drafters (out of the summary)
    earlier = {p: json.loads((out / p / "mt_bench.json").read_text()) for p in ("mt_bench", "long_history")}
    shutil.rmtree(runs / "speculators-s0")
    capsys.readouterr()
    from experiments.default_recipe.study import SMOKE

    two_seeds = [f"{key}={value}" for key, value in {**SMOKE, "seeds": "0,1"}.items()]  # not --smoke's seed
    two_seeds += ["levers=optimizer=muon", *keys[2:]]
    assert main([*two_seeds, *probes, *recipe]) == 0
    err = capsys.readouterr().err
    assert "skip (done): speculators-s0" in err and "train: speculators-s1" in err
    assert "measure: MT-Bench, long_history: eagle31-s1, speculators-s1, eagle31-optimizer-muon-s1\n" in err
    summary = json.loads((out / "summary.json").read_text())
    assert all(len(row[side]["tau"]) == 2 for row in summary["acceptance"] for side in ("eagle31", "speculators"))
    assert all(list(row["levers"]) == ["optimizer-muon"] for row in summary["levers"])
    for probe, before in earlier.items():
        report = json.loads((out / probe / "mt_bench.json").read_text())
        assert report["settings"]["kept"] == ["speculators-s0"]
        assert {r["drafter"] for r in report["results"]} == {*summary["training"], f"{vocab}-s0"}
        recorded = (r["settings"]["drafter_sha256"][f"{vocab}-s0"] for r in (report, before))
        assert len(set(recorded)) == 1
        seed0 = [r for r in report["results"] if r["drafter"].endswith("-s0")]
        assert seed0 == before["results"]  # the earlier rows, unchanged
    # joined only to a report of the same decoding of the target: another one is refused by name
    other = {**earlier["long_history"]}
    other["settings"] = {**other["settings"], "target_tokens_sha256": "0" * 64}
    (out / "long_history" / "mt_bench.json").write_text(json.dumps(other))
    capsys.readouterr()
    assert main([*two_seeds, *probes, *recipe]) == 2
    assert "long_history/mt_bench.json: the target decoded the questions otherwise" in capsys.readouterr().err


def test_original_replies_keep_the_regenerated_prompts_with_the_sources_replies(tmp_path):
    from eagle31.data.sources import Tally, read_conversations
    from experiments.default_recipe.original_replies import original_replies

    turns = [["Hi", "Hello!", "And you?", "Fine."], ["What is 2+2?", "4, as the sum of two and two."]]
    turns[1].insert(0, "Ask me.")  # a reply before the first user turn (ShareGPT has them): regenerate skips it
    source = tmp_path / "chats.jsonl"
    source.write_text(
        "".join(
            json.dumps(  # roles alternate back from the last message, a reply
                {
                    "messages": [
                        {"role": ("assistant", "user")[(len(c) - 1 - i) % 2], "content": t} for i, t in enumerate(c)
                    ]
                }
            )
            + "\n"
            for c in turns
        )
    )
    where = [c.where for c in read_conversations([source], Tally())]
    regenerated = tmp_path / "conversations"
    regenerated.mkdir()
    system = {"role": "system", "content": "Be brief."}
    records = [  # the first conversation asked its first turn only, under a drawn system prompt
        {
            "messages": [system, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey"}],
            "source": where[0],
        },
        {
            "messages": [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
            "source": where[1],
        },
    ]
    (regenerated / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "original.jsonl"
    assert original_replies(str(source), regenerated, out) == 2
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [[m["content"] for m in r["messages"]] for r in rows] == [
        ["Be brief.", "Hi", "Hello!"],
        ["What is 2+2?", "4, as the sum of two and two."],
    ]
    records[1]["source"] = f"{source}:9"
    (regenerated / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    with pytest.raises(SystemExit, match="1 regenerated records name no record of"):
        original_replies(str(source), regenerated, out)


@pytest.mark.parametrize("name", ["system_prompts.txt", "system_prompts_chat.txt"])
def test_the_system_prompt_mixes_hold_no_prompt_a_probe_measures(name):
    """A lever's data stays apart from the probes: neither mix holds an unseen prompt a probe measures under."""
    from pathlib import Path

    from eagle31.data.system_prompts import read_system_prompts
    from eagle31.targets.demo_corpus import OTHER_SYSTEM_PROMPT
    from experiments.default_recipe.study import UNSEEN_SYSTEM

    prompts = read_system_prompts(Path(__file__).parents[2] / "experiments" / "default_recipe" / name)
    assert len(prompts) == len(set(prompts)) == 8
    assert not {UNSEEN_SYSTEM, OTHER_SYSTEM_PROMPT} & set(prompts)  # MT-Bench's unseen_system, the demo's other_system
