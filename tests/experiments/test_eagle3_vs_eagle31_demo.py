"""experiments/eagle3_vs_eagle31/demo.py: what it trains and measures and the tables it writes; end to end at tiny
sizes (`--smoke`, slow: it builds the demo target once per machine)."""

import importlib
import json
from pathlib import Path

import pytest

from eagle31.errors import ConfigError
from eagle31_cli import parse_key_values

ROOT = Path(__file__).resolve().parents[2]
script = vars(importlib.import_module("experiments.eagle3_vs_eagle31.demo"))
CompareConfig = script["CompareConfig"]


def test_the_two_drafters_differ_only_in_the_eagle31_switches():
    cfg = parse_key_values(["seeds=3", "ttt_lengths=6", "max_steps=40", "runs=r"], CompareConfig)
    eagle3 = script["training_overrides"](cfg, ["train.lr=1e-3"], "eagle3", 6, 3)
    eagle31 = script["training_overrides"](cfg, ["train.lr=1e-3"], "eagle31", 6, 3)
    differ = set(eagle3) ^ set(eagle31)
    assert differ == {
        "output_dir=r/eagle3-ttt6-s3",
        "output_dir=r/eagle31-ttt6-s3",
        "drafter.fc_norm=false",
        "drafter.norm_output=false",
    }
    assert eagle3[:2] == ["recipe=demo", "train.lr=1e-3"]  # the user's overrides, then the comparison's own keys
    for arg in (
        "seed=3",
        "train.ttt_length=6",
        "train.max_steps=40",
        "data.prepared_dir=r/data",
        "eval.enabled=false",
        "resume=auto",
    ):
        assert arg in eagle3 and arg in eagle31
    # the ablation: one switch each
    assert set(script["training_overrides"](cfg, [], "fc_norm", 6, 3)) - set(eagle31) == {
        "output_dir=r/fc_norm-ttt6-s3",
        "drafter.norm_output=false",
    }
    assert set(script["training_overrides"](cfg, [], "norm_output", 6, 3)) - set(eagle31) == {
        "output_dir=r/norm_output-ttt6-s3",
        "drafter.fc_norm=false",
    }


def test_the_plan_trains_every_drafter_then_measures_each_ttt_length_at_each_k(capsys):
    argv = ["seeds=0,1", "ttt_lengths=5,7", "ks=3,6", "runs=r", "out=o", "splits=heldout,long_prompt", "dry_run=true"]
    assert script["main"](argv) == 0  # nothing built, trained or written
    lines = capsys.readouterr().out.splitlines()
    trains, measures = lines[:8], lines[8:]
    assert all(line.startswith("OMP_NUM_THREADS=1 python train/main.py recipe=demo output_dir=r/") for line in trains)
    assert [t.split("output_dir=r/")[1].split()[0] for t in trains[:4]] == [
        "eagle3-ttt5-s0",
        "eagle31-ttt5-s0",
        "eagle3-ttt5-s1",
        "eagle31-ttt5-s1",
    ]
    assert [m.split(":")[0] for m in measures] == [f"measure o/ttt{t}-k{k}" for t in (5, 7) for k in (3, 6)]
    assert measures[0] == (
        "measure o/ttt5-k3: k=3, eagle3-ttt5-s0, eagle3-ttt5-s1, eagle31-ttt5-s0, eagle31-ttt5-s1 "
        "on heldout, long_prompt"
    )
    cfg = parse_key_values(["ttt_lengths=5", "seeds=0", "runs=r"], CompareConfig)
    assert script["drafters"](cfg, 5) == {
        "eagle3-ttt5-s0": Path("r/eagle3-ttt5-s0/drafter"),
        "eagle31-ttt5-s0": Path("r/eagle31-ttt5-s0/drafter"),
    }
    assert script["parse_run_name"]("eagle31-ttt7-s1") == ("eagle31", 7, 1)


def test_every_training_and_the_measurement_are_recipes_of_the_demo():
    cfg = parse_key_values(["seeds=0", "ttt_lengths=5", "splits=heldout,long_prompt", "runs=r"], CompareConfig)
    from eagle31.recipe import load_recipe

    for overrides in script["trainings"](cfg, ["train.lr=1e-3"]).values():
        recipe = load_recipe(ROOT / "recipes", overrides)
        assert recipe.name == "demo" and recipe.train.lr == 1e-3 and recipe.output_dir.startswith("r/")
    assert list(script["measurement_recipe"](cfg, []).eval.data) == ["demo:heldout", "demo:long_prompt"]


@pytest.mark.parametrize(
    "arg, message",
    [
        ("ks=3,x", "ks must be"),
        ("ttt_lengths=0", "positive"),
        ("max_prompts=0", "max_prompts"),
        ("splits=,", "no split"),
        ("variants=eagle4", "variants must"),
    ],
)
def test_bad_arguments_are_one_line_errors(arg, message, capsys):
    with pytest.raises(ConfigError, match=message):
        parse_key_values([arg], CompareConfig)
    assert script["main"]([arg]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.slow
def test_tables_and_plot_from_a_summary(tmp_path):
    cfg = parse_key_values(["seeds=0,1", "ttt_lengths=5", "ks=2,3", "splits=heldout,long_prompt"], CompareConfig)
    training = [
        {
            "variant": v,
            "ttt_length": 5,
            "seed": s,
            "tau_sim": 2.5,
            "acc": [0.7] * 5,
            "eval_loss": 0.5,
            "train_time_s": 99.0,
            "steps": 300,
            "tokens_seen": 1,
        }
        for v in ("eagle3", "eagle31")
        for s in (0, 1)
    ]
    results = []
    for k in (2, 3):
        for v, base in (("eagle3", 2.0), ("eagle31", 2.5)):
            rows = [
                {
                    "drafter": f"{v}-ttt5-s{s}",
                    "tau": base + s / 10,
                    "acceptance_rate": [0.8, 0.4, 0.2][:k],
                    "prompts": 4,
                    "mean_prompt_tokens": 50.0,
                }
                for s in (0, 1)
            ]
            results += [script["mean_over_seeds"](rows, 5, k, split, v) for split in cfg.splits_list]
    summary = {"settings": vars(cfg), "training": training, "acceptance": results}
    table = script["format_results"](summary)
    assert "| 5 | 3 | long_prompt | 4 | 50 | 2.050 (2.000, 2.100) | 2.550 (2.500, 2.600) | +0.500 |" in table
    assert "| 5 | 2 | heldout | EAGLE 3.1 | 0.800 | 0.400 |  |" in table
    script["plot_results"](summary, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_table_of_four_variants_and_feature_scale(tmp_path):
    variants = ("eagle3", "fc_norm", "norm_output", "eagle31")
    cfg = parse_key_values(
        ["seeds=0", "ttt_lengths=5", "ks=2", "splits=heldout", "variants=" + ",".join(variants)], CompareConfig
    )
    training = [
        {
            "variant": v,
            "ttt_length": 5,
            "seed": 0,
            "tau_sim": 2.5,
            "acc": [0.7],
            "eval_loss": 0.5,
            "train_time_s": 9.0,
            "steps": 3,
            "tokens_seen": 1,
        }
        for v in variants
    ]
    rows = {
        v: [
            {
                "drafter": f"{v}-ttt5-s0",
                "tau": 2.0 + i / 10,
                "acceptance_rate": [0.5, 0.5],
                "prompts": 4,
                "mean_prompt_tokens": 50.0,
            }
        ]
        for i, v in enumerate(variants)
    }
    acceptance = [script["mean_over_seeds"](rows[v], 5, 2, "heldout", v) for v in variants]
    scale = {
        "aux_layer_ids": [2, 4],
        "trained_len": 384,
        "splits": {"heldout": {"aux layer 2": {"below": 9.5, "beyond": None}, "final": {"below": 1.25, "beyond": 1.5}}},
    }
    table = script["format_results"](
        {"settings": vars(cfg), "training": training, "acceptance": acceptance, "feature_scale": scale}
    )
    assert (
        "| 5 | 2 | heldout | 4 | 50 | 2.000 (2.000) | 2.100 (2.100) | 2.200 (2.200) | 2.300 (2.300) | +0.300 |" in table
    )
    assert "| heldout | 9.50 / – | 1.25 / 1.50 |" in table


@pytest.mark.slow
def test_feature_scale_is_the_rms_of_the_targets_hidden_states(tmp_path):
    """The RMS table reads the aux layers' inputs and lm_head's input, split at the training length."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle31.eval.acceptance import load_prompts
    from eagle31.targets.demo import demo_corpus_dir, ensure_demo_target

    target = ensure_demo_target()
    (tmp_path / "long_prompt.jsonl").write_text(
        (demo_corpus_dir() / "long_prompt.jsonl").read_text().splitlines()[0] + "\n"
    )
    cfg = parse_key_values(["splits=long_prompt"], CompareConfig)
    scale = script["feature_scale"](cfg, target, tmp_path, trained_len=100)
    [prompt] = load_prompts(tmp_path / "long_prompt.jsonl", AutoTokenizer.from_pretrained(target), 16)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states  # [layers + 1] x [1, T, H]
    rms = lambda h: h[0].pow(2).mean(-1).sqrt()  # noqa: E731
    for layer in scale["aux_layer_ids"]:  # aux id k: the input of decoder layer k (vLLM's convention)
        expected = rms(hidden[layer])
        got = scale["splits"]["long_prompt"][f"aux layer {layer}"]
        assert got["below"] == pytest.approx(expected[:100].mean().item(), rel=1e-4)
        assert got["beyond"] == pytest.approx(expected[100:].mean().item(), rel=1e-4)
    assert scale["splits"]["long_prompt"]["final"]["beyond"] == pytest.approx(
        rms(hidden[-1])[100:].mean().item(), rel=1e-4
    )


def test_commands_log_names_the_cache_by_its_variable(tmp_path, monkeypatch):
    from experiments.harness import log_command

    cache = tmp_path / "cache"
    monkeypatch.setenv("EAGLE31_CACHE", str(cache))
    log_command(tmp_path, f"OMP_NUM_THREADS=1 python -m experiments.eagle3_vs_eagle31.demo runs={cache}/runs")
    log = (tmp_path / "commands.sh").read_text()
    assert "from the repository root" in log and "runs=$EAGLE31_CACHE/runs" in log and str(cache) not in log


@pytest.mark.slow
def test_smoke_trains_both_drafters_and_measures_them_into_the_results_of_the_full_comparison(tmp_path, capsys):
    """End to end at tiny sizes on the demo target (built once per machine, minutes): the files the full comparison
    writes."""
    out, runs = tmp_path / "out", tmp_path / "runs"
    assert script["main"](["--smoke", f"out={out}", f"runs={runs}", "threads=2"]) == 0
    assert {p.name for p in runs.iterdir()} >= {"data", "eagle3-ttt2-s0", "eagle31-ttt2-s0"}
    report = json.loads((out / "ttt2-k2" / "acceptance.json").read_text())
    assert {(r["drafter"], r["split"]) for r in report["results"]} == {
        ("eagle3-ttt2-s0", "heldout"),
        ("eagle31-ttt2-s0", "heldout"),
    }
    summary = json.loads((out / "summary.json").read_text())
    assert [(t["variant"], t["steps"]) for t in summary["training"]] == [("eagle3", 2), ("eagle31", 2)]
    assert "| 2 | 2 | heldout | 1 |" in (out / "results.md").read_text() and (out / "comparison.png").is_file()
    assert "experiments.eagle3_vs_eagle31.demo --smoke" in (out / "commands.sh").read_text()
    first = (out / "ttt2-k2" / "acceptance.json").read_text()
    assert (
        script["main"](["--smoke", f"out={out}", f"runs={runs}", "threads=2"]) == 0
    )  # resumed: nothing trained or measured again
    assert (out / "ttt2-k2" / "acceptance.json").read_text() == first
    assert "skip (done): eagle3-ttt2-s0" in capsys.readouterr().err


def test_committed_results_carry_no_machine_paths():
    for path in [*(ROOT / "benchmarks" / "results").rglob("*"), *ROOT.glob("experiments/*/results/**/*")]:
        if path.suffix in (".json", ".md", ".sh"):
            text = path.read_text()
            for machine in ("/root/", "/home/", "/work/", "(cd /"):
                assert machine not in text, f"{path.relative_to(ROOT)} names {machine!r}"
