"""experiments/parallel_drafting: chain and parallel drafters (eagle31's, and speculators' own P-EAGLE) trained on the
same data and measured together; end to end at tiny sizes (`--smoke`) on the tiny chat target; its crossover and
speedup arithmetic by hand."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.experiments.test_side_by_side import tiny_overrides


@pytest.mark.slow
def test_smoke_trains_every_side_measures_tau_and_costs_and_keeps_them(tiny_target, chats, tmp_path, capsys):
    from experiments.parallel_drafting.study import main
    from tests.peers import peer_module

    peer_module("speculators.models.peagle.core")

    out, runs = tmp_path / "out", tmp_path / "runs"
    args = ["--smoke", f"out={out}", f"runs={runs}", "--", *tiny_overrides(tiny_target, chats)]
    assert main(args) == 0
    for side, parallel, decay in (("chain", False, 0.8), ("parallel", True, None)):
        config = yaml.safe_load((runs / f"{side}-s0" / "config.yaml").read_text())
        assert config["drafter"]["parallel_drafting"] is parallel and config["train"]["ttt_decay"] == decay
        assert config["train"]["ttt_length"] == 3 and config["train"]["max_steps"] == 2
    peer = runs / "speculators-s0"
    assert json.loads((peer / "drafter" / "config.json").read_text())["speculators_model_type"] == "peagle"
    assert json.loads((peer / "report.json").read_text())["steps"] == 2
    summary = json.loads((out / "summary.json").read_text())
    sides = ("chain", "parallel", "speculators")
    assert {(r["k"], r["side"]) for r in summary["acceptance"]} == {(k, s) for k in (2, 3) for s in sides}
    assert all(len(r["acceptance_rate"]) == r["k"] and r["mean"] >= 1 for r in summary["acceptance"])
    report = json.loads((out / "k3" / "acceptance.json").read_text())
    assert report["settings"]["k"] == 3 and {r["drafter"] for r in report["results"]} == {f"{s}-s0" for s in sides}
    costs = json.loads((out / "costs.json").read_text())
    for k in ("2", "3"):
        assert costs["target"]["verify"][k]["n"] > 0 and costs["target"]["verify"][k]["median"] > 0
        for label in ("chain-s0", "parallel-s0"):
            timed = costs["drafters"][label][k]
            assert timed["round"]["n"] == timed["draft"]["n"] == timed["step0_pass"]["n"] > 0
    assert costs["drafters"]["parallel-s0"]["3"]["parallel_drafting"] is True
    (row,) = [r for r in summary["speedup"] if r["k"] == 3]
    assert row["chain"]["forwards_per_round"] == 3 and row["parallel"]["forwards_per_round"] == 1
    assert row["speculators"]["drafter_s"] == row["parallel"]["drafter_s"]  # the same shape, one forward
    assert row["chain"]["speedup"] > 0 and set(summary["paper_ratios"]) == {
        "demo",
        "smollm2_135m",
        "llama31_8b",
        "kimi_k26_llama",
    }
    text = (out / "results.md").read_text()
    assert "S = tau * T_1 / (T_verify(k) + D(k))" in text and "| Llama 3.1 8B |" in text
    assert "experiments.parallel_drafting --smoke" in (out / "commands.sh").read_text()
    # a second call trains, measures and times nothing again
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "skip (done): parallel-s0" in err and "kept (measured earlier, same weights): parallel-s0" in err
    assert "skip (done): speculators-s0" in err
    assert "kept (measured earlier, same settings and weights)" in err
    assert json.loads((out / "summary.json").read_text())["speedup"] == summary["speedup"]


def test_the_parallel_side_is_recipe_demo_parallel():
    """`PARALLEL` over recipe=demo composes recipe=demo_parallel's drafter and training."""
    from eagle31.recipe import load_recipe, to_container
    from experiments.harness import ROOT
    from experiments.parallel_drafting.study import PARALLEL

    ours = to_container(load_recipe(ROOT / "recipes", ["recipe=demo", *PARALLEL]))
    theirs = to_container(load_recipe(ROOT / "recipes", ["recipe=demo_parallel"]))
    for section in ("drafter", "train", "features", "data"):
        for key in ("prepared_dir", "store_dir"):  # named after the recipe
            ours[section].pop(key, None), theirs[section].pop(key, None)
        assert ours[section] == theirs[section], section


def test_the_crossover_is_where_one_parallel_forward_and_k_chain_forwards_give_the_same_speedup():
    from experiments.parallel_drafting.study import crossover

    def speedup(tau, forwards, c):  # the target's verification costs 1, a drafter forward c
        return tau / (1 + forwards * c)

    for tau_chain, tau_par, k, rho in ((3.0, 2.5, 3, 1.0), (4.2, 2.9, 7, 1.0), (3.0, 2.5, 5, 1.6)):
        c = crossover(tau_chain, tau_par, k, rho)
        assert speedup(tau_par, rho, c) == pytest.approx(speedup(tau_chain, k, c))
        assert speedup(tau_par, rho, c * 1.1) > speedup(tau_chain, k, c * 1.1)
        assert speedup(tau_par, rho, c * 0.9) < speedup(tau_chain, k, c * 0.9)
    assert crossover(3.0, 3.2, 5) == 0.0  # parallel accepts more: it wins at any cost
    assert crossover(3.0, 3.0, 5) == 0.0
    assert crossover(4.0, 1.0, 3) is None  # k tau_par <= tau_chain: k forwards of the chain still cost less per token


def test_the_speedup_reads_tau_and_the_measured_costs():
    from experiments.parallel_drafting.study import ParallelDraftingConfig, speedups

    cfg = ParallelDraftingConfig(seeds="0,1", ks="3")
    rows = [
        {"split": "heldout", "k": 3, "side": "chain", "mean": 3.0},
        {"split": "heldout", "k": 3, "side": "parallel", "mean": 2.5},
        {"split": "heldout", "k": 3, "side": "speculators", "mean": 2.4},
    ]
    costs = {
        "target": {"plain_forward": {"median": 0.010}, "verify": {"3": {"median": 0.012}}},
        "drafters": {
            "chain-s0": {"3": {"round": {"median": 0.006}}},
            "parallel-s0": {"3": {"round": {"median": 0.003}}},
        },
    }
    (row,) = speedups(cfg, rows, costs, "heldout")
    assert row["chain"]["speedup"] == pytest.approx(3.0 * 0.010 / (0.012 + 0.006))
    assert row["parallel"]["speedup"] == pytest.approx(2.5 * 0.010 / (0.012 + 0.003))
    assert row["speculators"]["speedup"] == pytest.approx(2.4 * 0.010 / (0.012 + 0.003))  # the parallel one's D
    assert row["cost_ratio"] == pytest.approx(0.002 / 0.012) and row["rho"] == pytest.approx(1.5)
    assert row["crossover"] == pytest.approx(0.5 / 4.5)


def test_a_k_past_the_training_depth_is_one_line(capsys):
    from experiments.parallel_drafting.study import main

    assert main(["ks=3,9", "ttt_length=7"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: ttt_length=7 is below the largest k=9: every measured depth must be trained"
