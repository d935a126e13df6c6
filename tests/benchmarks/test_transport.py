"""benchmarks/transport.py at a small size, as a user runs it: both transports measured in one run, the table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers import mooncake_store

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a Ray cluster and a Mooncake master: about 40 s on 2 cores
@pytest.mark.deadline(300)
def test_the_transport_benchmark_measures_both_transports_in_one_run(tmp_path):
    mooncake_store()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.transport", "samples=1", "rounds=1", "tokens=64", "hidden=256",
         f"out={tmp_path}"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "transport.json").read_text())
    assert result["sample_bytes"] == 64 * 4 * 256 * 2
    assert set(result["transports"]) == {"ray", "mooncake"}
    assert all(p["bytes_per_s"] > 0 and len(p["total_s"]) == 1 for p in result["transports"].values())
    ratio = result["transports"]["mooncake"]["bytes_per_s"] / result["transports"]["ray"]["bytes_per_s"]
    assert result["mooncake_over_ray"] == pytest.approx(ratio)
    assert "| mooncake |" in (tmp_path / "transport.md").read_text()


def test_bad_benchmark_arguments_are_one_line(capsys):
    from benchmarks import transport
    from eagle31_cli import run_cli

    assert run_cli(lambda: transport.main(["tokens"])) == 2
    assert capsys.readouterr().err.strip() == "error: arguments are key=value, got 'tokens'"
