"""scripts/compare_eagle3_eagle31.py (issue 7): the commands it runs and the tables it writes, not the comparison itself."""

import runpy
from pathlib import Path

import pytest

from eagle31.cli import parse_key_values
from eagle31.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
script = runpy.run_path(str(ROOT / "scripts" / "compare_eagle3_eagle31.py"))
CompareConfig = script["CompareConfig"]


def test_the_two_drafters_differ_only_in_the_eagle31_switches():
    cfg = parse_key_values(["seeds=3", "ttt_lengths=6", "max_steps=40", "runs=r"], CompareConfig)
    eagle3 = script["train_command"](cfg, "eagle3", 6, 3)
    eagle31 = script["train_command"](cfg, "eagle31", 6, 3)
    differ = set(eagle3) ^ set(eagle31)
    assert differ == {"output_dir=r/eagle3-ttt6-s3", "output_dir=r/eagle31-ttt6-s3", "drafter.fc_norm=false", "drafter.norm_output=false"}
    for arg in ("recipe=demo", "seed=3", "train.ttt_length=6", "train.max_steps=40", "data.prepared_dir=r/data", "eval.enabled=false"):
        assert arg in eagle3 and arg in eagle31


def test_plan_trains_every_drafter_before_evaluating_each_k(tmp_path):
    cfg = parse_key_values(["seeds=0,1", "ttt_lengths=5,7", "ks=3,6", "runs=r", "out=o", "splits=heldout,long_prompt"], CompareConfig)
    steps = script["plan"](cfg, tmp_path / "target", tmp_path / "corpus")
    trains, evals = steps[:8], steps[8:]
    assert all(c[1] == "train/main.py" for c, _ in trains) and len(evals) == 4
    assert [str(out) for _, out in evals] == [f"o/ttt{t}-k{k}/acceptance.json" for t in (5, 7) for k in (3, 6)]
    command = evals[0][0]
    drafters = next(a for a in command if a.startswith("drafter=")).removeprefix("drafter=").split(",")
    assert drafters == [f"{v}-ttt5-s{s}=r/{v}-ttt5-s{s}/drafter" for v in ("eagle3", "eagle31") for s in (0, 1)]
    assert f"data=heldout={tmp_path}/corpus/heldout.jsonl,long_prompt={tmp_path}/corpus/long_prompt.jsonl" in command
    assert script["parse_run_name"]("eagle31-ttt7-s1") == ("eagle31", 7, 1)


@pytest.mark.parametrize("arg, message", [("ks=3,x", "ks must be"), ("ttt_lengths=0", "positive"), ("max_prompts=0", "max_prompts"), ("splits=,", "no split")])
def test_bad_arguments_are_one_line_errors(arg, message):
    with pytest.raises(ConfigError, match=message):
        parse_key_values([arg], CompareConfig)


def test_tables_and_plot_from_a_summary(tmp_path):
    cfg = parse_key_values(["seeds=0,1", "ttt_lengths=5", "ks=2,3", "splits=heldout,long_prompt"], CompareConfig)
    training = [
        {"variant": v, "ttt_length": 5, "seed": s, "tau_sim": 2.5, "acc": [0.7] * 5, "eval_loss": 0.5, "train_time_s": 99.0, "steps": 300, "tokens_seen": 1}
        for v in ("eagle3", "eagle31") for s in (0, 1)
    ]  # fmt: skip
    results = []
    for k in (2, 3):
        for v, base in (("eagle3", 2.0), ("eagle31", 2.5)):
            rows = [{"drafter": f"{v}-ttt5-s{s}", "tau": base + s / 10, "acceptance_rate": [0.8, 0.4, 0.2][:k], "prompts": 4, "mean_prompt_tokens": 50.0} for s in (0, 1)]
            results += [script["mean_over_seeds"](rows, 5, k, split, v) for split in cfg.splits_list]
    summary = {"settings": vars(cfg), "training": training, "acceptance": results}
    table = script["format_results"](summary)
    assert "| 5 | 3 | long_prompt | 4 | 50 | 2.050 (2.000, 2.100) | 2.550 (2.500, 2.600) | +0.500 |" in table
    assert "| 5 | 2 | heldout | EAGLE 3.1 | 0.800 | 0.400 |  |" in table
    script["plot_results"](summary, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
