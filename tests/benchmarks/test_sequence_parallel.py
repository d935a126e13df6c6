"""benchmarks/sequence_parallel.py: a real (tiny) run at N = 1 and 2, its table, and its refusals."""

import json

import pytest

from benchmarks.sequence_parallel import main


@pytest.mark.slow
def test_a_split_sequence_holds_less_per_rank_and_exchanges_its_keys(tmp_path):
    out = tmp_path / "sp.json"
    assert main(["seq_len=256", "sizes=1,2", "repeats=1", f"out={out}"]) == 0
    one, two = json.loads(out.read_text())["runs"]
    assert one["exchanged_bytes_per_step_per_rank"] == [0]  # one process: nothing crosses
    assert (
        len(two["peak_tensor_bytes_per_rank"]) == 2
        and max(two["peak_tensor_bytes_per_rank"]) < one["peak_tensor_bytes_per_rank"][0]
    )
    # at least: the step-0 latents (64 + 16 fp32 a token) of the other shard, gathered in the step and again in its
    # recompute
    assert min(two["exchanged_bytes_per_step_per_rank"]) >= 2 * 128 * 80 * 4
    table = (tmp_path / "sp.md").read_text()
    assert "| 1 | " in table and "| 2 | " in table


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    assert main(["bogus"]) == 2 and main(["attention=gpt"]) == 2 and main(["sizes=a"]) == 2
    assert capsys.readouterr().err.count("\n") == 3
