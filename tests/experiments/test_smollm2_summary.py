"""experiments/eagle3_vs_eagle31/smollm2_summary.py: the tables of the SmolLM2 comparison, from evaluation files (not
the comparison itself)."""

import json

import pytest

from eagle31.errors import ConfigError
from experiments.eagle3_vs_eagle31.smollm2_summary import SummaryConfig, format_results, parse_label, summarize, verdict

TAU = {  # (probe, label) -> tau over all questions at chain-k3
    ("mt_bench", "eagle3-s0"): 1.50,
    ("mt_bench", "eagle3-s1"): 1.60,
    ("mt_bench", "eagle31-s0"): 1.70,
    ("mt_bench", "eagle31-s1"): 1.80,
    ("mt_bench_long_history", "eagle3-s0"): 1.40,
    ("mt_bench_long_history", "eagle3-s1"): 1.55,
    ("mt_bench_long_history", "eagle31-s0"): 1.50,
    ("mt_bench_long_history", "eagle31-s1"): 1.45,
}


def write_results(tmp_path):
    out, runs = tmp_path / "out", tmp_path / "runs"
    labels = ["eagle3-s0", "eagle3-s1", "eagle31-s0", "eagle31-s1"]
    for probe in ("mt_bench", "mt_bench_long_history"):
        results = []
        for label in labels:
            tau = TAU[(probe, label)]
            for split, t in (("all", tau), ("coding", tau + 0.5), ("writing", tau - 0.25)):
                results.append(
                    {
                        "drafter": label,
                        "mode": "chain-k3",
                        "split": split,
                        "tau": t,
                        "prompts": 4,
                        "mean_prompt_tokens": 100.0,
                        "acceptance_rate": [t - 1, 0.0, 0.0],
                        "conditional_acceptance_rate": [t - 1, 0.5, 0.25],
                    }
                )
        settings = {
            "drafters": {label: f"{runs}/{label}/drafter" for label in labels},
            "target": "t",
            "max_new_tokens": 8,
        }
        (out / probe).mkdir(parents=True)
        (out / probe / "mt_bench.json").write_text(json.dumps({"settings": settings, "results": results}))
    for i, label in enumerate(labels):
        (runs / label).mkdir(parents=True)
        report = {
            "tau_sim": 1.5 + i / 10,
            "acc": [0.5],
            "eval_loss": 3.0,
            "train_time_s": 60.0,
            "steps": 10,
            "tokens_seen": 100,
        }
        (runs / label / "report.json").write_text(json.dumps(report))
    return SummaryConfig(out=str(out), runs=str(runs))


def test_summary_means_seeds_and_says_what_holds_outside_their_spread(tmp_path):
    summary = summarize(write_results(tmp_path), target_dir=None)
    rows = {(a["probe"], a["variant"]): a for a in summary["acceptance"]}
    assert rows[("mt_bench", "eagle31")]["tau"] == [1.70, 1.80]
    assert rows[("mt_bench", "eagle31")]["tau_mean"] == pytest.approx(1.75)
    assert rows[("mt_bench", "eagle3")]["conditional_acceptance_rate_mean"] == pytest.approx([0.55, 0.5, 0.25])
    assert [t["seed"] for t in summary["training"]] == [0, 1, 0, 1]

    table = format_results(summary)
    assert (
        "| MT-Bench | chain-k3 | 100 | 1.550 (1.500, 1.600) | 1.750 (1.700, 1.800) "
        "| +0.200, higher, outside the seed spread |" in table
    )
    assert (
        "| MT-Bench after a long history | chain-k3 | 100 | 1.475 (1.400, 1.550) | 1.475 (1.500, 1.450) "
        "| +0.000, within the seed spread |" in table
    )
    assert "| chain-k3 | EAGLE 3.1 | 1.750 | 2.250 | 1.500 |" in table  # per category, mean over seeds
    assert "under an unseen system prompt" not in table  # a probe that was not run has no rows


def test_verdict_and_labels():
    assert verdict([2.0, 2.1], [1.5, 1.9]) == "higher, outside the seed spread"
    assert verdict([1.0, 1.2], [1.5, 1.9]) == "lower, outside the seed spread"
    assert verdict([1.6, 2.0], [1.5, 1.9]) == "within the seed spread"
    assert verdict([2.0], [1.5, 1.9]) == "one seed: no spread to compare with"
    assert parse_label("norm_output-s12") == ("norm_output", 12)
    for bad in ("eagle31", "eagle4-s0", "eagle31-sx"):
        with pytest.raises(ConfigError, match="<variant>-s<seed>"):
            parse_label(bad)


def test_missing_evaluation_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="mt_bench.json: not found; run scripts/smollm2_chain.sh"):
        summarize(SummaryConfig(out=str(tmp_path), runs=str(tmp_path)), target_dir=None)


def test_fc_share_follows_the_scale_of_each_aux_layer_unless_fc_norm_removes_it():
    import torch

    from experiments.eagle3_vs_eagle31.smollm2_summary import fc_share
    from tests.helpers import tiny_drafter

    eagle3 = tiny_drafter(dtype=torch.float32, fc_norm=False, norm_output=False)
    eagle31 = tiny_drafter(dtype=torch.float32)
    n, Ht = eagle3.config.num_aux, eagle3.config.target_hidden_size
    aux = torch.randn(64, n * Ht)
    base3, base31 = fc_share(eagle3, aux), fc_share(eagle31, aux)
    assert sum(base3) == pytest.approx(1) and sum(base31) == pytest.approx(1)
    aux[:, :Ht] *= 100  # the first aux layer 100x louder, as SmolLM2's layer 15 is at its first position
    louder3, louder31 = fc_share(eagle3, aux), fc_share(eagle31, aux)
    assert louder3[0] > 0.9 > base3[0]
    assert louder31 == pytest.approx(base31, rel=1e-3)
