"""The training-step benchmark (benchmarks/): shapes from the recipes, FLOP count, reporting,
the command, and speed against `speculators`."""

import json
from pathlib import Path

import pytest
import yaml

from benchmarks.benchmark_train_step import main
from benchmarks.measure import run_benchmark
from benchmarks.report import update_table
from benchmarks.train_step import BenchConfig
from eagle31.errors import ConfigError
from eagle31.estimate import count_parameters, step_flops
from tests.helpers import tiny_config
from tests.peers import missing_peer

ROOT = Path(__file__).resolve().parents[2]


def test_step_flops_by_hand():
    cfg = tiny_config()  # H 16, nh 4, nkv 2, d 8, I 24, Vd 24, 3 aux of 16
    T, K = 10, 2
    fc = 2 * 2 * T * 48 * 16
    per_step = 2 * T * (32 * (4 + 4) * 8 + 32 * 16 + 3 * 16 * 24 + 16 * 24)
    attention = 4 * 4 * 8 * (55 + 0) + 4 * 4 * 8 * (55 + 10)  # T(T+1)/2 causal pairs, + k T chain pairs
    assert step_flops(cfg, T, K) == fc + 3 * (K * per_step + attention)


@pytest.mark.parametrize("recipe", ["kimi_k26", "llama31_8b"])
def test_shapes_are_the_recipes_drafters(recipe):
    """Read straight from the recipe file and its target config: nothing typed twice."""
    text = yaml.safe_load((ROOT / "recipes" / "recipe" / f"{recipe}.yaml").read_text())
    target = json.loads((ROOT / "recipes" / "targets" / f"{recipe}.json").read_text())
    target = target.get("text_config", target)
    cfg = BenchConfig(shape=recipe, seq_len=65536).drafter_config()
    drafter = text["drafter"]  # a null field takes the target's value
    assert cfg.hidden_size == target["hidden_size"] and cfg.vocab_size == target["vocab_size"]
    assert cfg.num_attention_heads == (drafter.get("num_attention_heads") or target["num_attention_heads"])
    assert cfg.num_key_value_heads == (drafter.get("num_key_value_heads") or target["num_key_value_heads"])
    assert cfg.intermediate_size == (drafter.get("intermediate_size") or target["intermediate_size"])
    assert cfg.draft_vocab_size == drafter["draft_vocab_size"]
    assert cfg.max_position_embeddings >= 65536 + 7


def test_config_reads_key_values_and_names_bad_ones():
    bench = BenchConfig.from_args(["shape=llama31_8b", "T=8192", "ttt=5", "ckpt=true", "peer=speculators"])
    assert (bench.seq_len, bench.ttt_length, bench.activation_checkpointing) == (8192, 5, True)
    assert bench.drafter_config().num_key_value_heads == 8
    with pytest.raises(ConfigError, match="gpt5"):
        BenchConfig.from_args(["shape=gpt5"])
    with pytest.raises(ConfigError, match="no shipped target config"):
        BenchConfig.from_args(
            ["shape=kimi_k26_mini"]
        )  # its target is built locally with random weights: no fixed shape
    with pytest.raises(ConfigError, match="unknown argument"):
        BenchConfig.from_args(["seqlen=4"])
    with pytest.raises(ConfigError, match="T="):
        BenchConfig.from_args(["T=many"])


def test_table_rows_are_added_and_replaced(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text("# Performance\n\nNotes above the table stay.\n")

    def result(T, step):
        run = {"step_s": step, "step_s_all": [step], "tokens_per_s": T / step, "mfu": None, "peak_gib": 1.0}
        config = {"shape": "tiny", "seq_len": T, "ttt_length": 3, "activation_checkpointing": False}
        return {
            "date": "2026-01-01",
            "device": "cpu",
            "torch": "2.13",
            "precision": "float32",
            "config": config,
            "runs": {"eagle31": run},
        }

    update_table(doc, result(1024, 2.0))
    update_table(doc, result(2048, 4.0))
    update_table(doc, result(1024, 1.0))  # same key: replaces the first row
    text = doc.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 2026")]
    assert "Notes above the table stay." in text
    assert len(rows) == 2 and "| 2048 |" in rows[0] and "1.000 s" in rows[1]


def test_command_writes_json_and_a_table_row(tmp_path):
    out, doc = tmp_path / "r.json", tmp_path / "perf.md"
    assert (
        main(["shape=tiny", "T=64", "ttt=2", "warmup=0", "repeats=1", "memory=false", f"out={out}", f"doc={doc}"]) == 0
    )
    result = json.loads(out.read_text())
    ours = result["runs"]["eagle31"]
    assert ours["step_s"] > 0 and ours["tokens_per_s"] == pytest.approx(64 / ours["step_s"])
    assert result["flops_per_step"] == step_flops(BenchConfig(shape="tiny").drafter_config(), 64, 2)
    assert set(result["attention_parity"]) == {"flash", "blockwise"}
    assert "| tiny | 64 | 2 |" in doc.read_text()


def test_command_refuses_an_unknown_key(capsys):
    assert main(["sequence=4"]) == 2
    assert "unknown argument" in capsys.readouterr().err


@pytest.mark.slow
def test_the_comparison_with_speculators_trains_the_same_model_and_reports_both_steps():
    """The side-by-side of `peer=speculators`: the same shape, flags and K, the same number of trainable
    parameters, both steps timed (interleaved) and their ratios reported. Which is faster is the benchmark's to
    measure and report (docs/performance.md), not a unit test's to assert on shared cores."""
    from benchmarks.peer import SpeculatorsStep, speculators_unavailable

    reason = speculators_unavailable()
    if reason:
        missing_peer(f"no speculators to compare with: {reason}")
    bench = BenchConfig(
        shape="tiny", seq_len=256, ttt_length=3, peer="speculators", warmup=0, repeats=2, memory=False, threads=1
    )
    peer = SpeculatorsStep(bench)
    trainable = sum(p.numel() for p in peer.model.parameters() if p.requires_grad)
    assert trainable == count_parameters(bench.drafter_config()).trainable  # the same model is trained
    del peer
    result = run_benchmark(bench)
    ours, theirs = result["runs"]["eagle31"], result["runs"]["speculators"]
    assert len(ours["step_s_all"]) == len(theirs["step_s_all"]) == bench.repeats
    assert result["speedup"] == pytest.approx(theirs["step_s"] / ours["step_s"])
    assert result["speedup_best"] == pytest.approx(min(theirs["step_s_all"]) / min(ours["step_s_all"]))
