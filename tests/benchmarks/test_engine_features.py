"""benchmarks/engine_features.py without its runs: the comparison of two runs, the measurements, the table, bad
input."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import engine_features as bench
from eagle31_cli import run_cli

# the rates every window of `fake_run` logs: its one worker's and its one trainer's, in samples/s
WORKER_RATE, TRAINER_RATE = 1.0, 4.0


def fake_run(path, losses, weight, consumed="aa", waits=(2.0, 1.0, 1.0)):
    """A run directory as the pipeline leaves it, as far as the benchmark reads it."""
    (path / "drafter").mkdir(parents=True)
    save_file(
        {"w": torch.tensor([weight]), "t2d": torch.tensor([True, False])}, str(path / "drafter" / "model.safetensors")
    )
    engine = {"engine/workers": 1, "engine/trainers": 1, "engine/worker_restarts": 0, "engine/requeued": 0}
    rates = {
        "train/samples_per_s": 2.0,
        "train/capacity_samples_per_s": TRAINER_RATE,
        "engine/inference_samples_per_s": WORKER_RATE,
    }
    lines = [
        {"step": 5 * (i + 1), "train/loss": loss, "train/wait_s": wait, **rates, **engine}
        for i, (loss, wait) in enumerate(zip(losses, waits))
    ]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (path / "checkpoints" / "step_00000015").mkdir(parents=True)
    state = {"data_ranks": [{"consumed": {"samples": 9, "sha256": consumed}}]}
    (path / "checkpoints" / "step_00000015" / "trainer_state.json").write_text(json.dumps(state))
    return path


def test_same_run_tells_equal_runs_from_runs_that_differ_in_losses_weights_or_samples(tmp_path):
    a = fake_run(tmp_path / "a", [3.0, 2.0, 1.0], 0.5)
    assert bench.same_run(a, fake_run(tmp_path / "b", [3.0, 2.0, 1.0], 0.5)) == {
        "losses_equal": True,
        "weights_max_abs_diff": 0.0,
        "weights_equal": True,
        "consumed_equal": True,
    }
    other = bench.same_run(a, fake_run(tmp_path / "c", [3.0, 2.0, 1.5], 0.5 + 2**-20, consumed="bb"))
    assert other == {
        "losses_equal": False,
        "weights_max_abs_diff": pytest.approx(2**-20),
        "weights_equal": False,
        "consumed_equal": False,
    }


def test_measure_takes_medians_after_the_first_window_and_the_table_shows_ratios(tmp_path):
    one = bench.measure(fake_run(tmp_path / "one", [1, 1, 1], 0.0, waits=(9.0, 1.0, 1.0)), 1)
    two = bench.measure(fake_run(tmp_path / "two", [1, 1, 1], 0.0, waits=(9.0, 0.5, 0.5)), 2)
    assert (one["wait_s_per_step"], two["wait_s_per_step"]) == (1.0, 0.5)
    # workers = ceil(trainers * one trainer's rate / one worker's rate), for one trainer
    assert one["workers_for_one_trainer"] == math.ceil(1 * TRAINER_RATE / WORKER_RATE)
    lines = bench.scaling_table([one, two])
    assert lines[2].startswith("| 1 | 1.000 | 1.00x |") and lines[3].startswith("| 2 | 0.500 | 0.50x |")


def test_a_bad_argument_is_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["engine_features", "worker=2"])
    assert run_cli(lambda: bench.main(sys.argv[1:])) == 2
    assert "unknown argument 'worker'" in capsys.readouterr().err
