"""The regeneration throughput benchmark at tiny size: it runs, counts every request, writes its results."""

from __future__ import annotations

import json

import pytest

from benchmarks.regenerate_throughput import main
from tests.peers import peer_python


@pytest.mark.slow  # starts the vLLM-like server (~20 s)
def test_benchmark_runs_at_tiny_size(tmp_path):
    python = peer_python("0.33.0")
    assert main(["concurrency=1,4", "latency_s=0.05", "waves=4", f"out={tmp_path}", f"python={python}"]) == 0
    result = json.loads((tmp_path / "regenerate_throughput.json").read_text())
    assert [r["concurrency"] for r in result["results"]] == [1, 4]
    assert [r["requests"] for r in result["results"]] == [4, 16]  # c * waves
    assert all(0 < r["efficiency"] <= 1.0 for r in result["results"])  # never faster than c / latency
    assert result["settings"]["server"]["vllm"] == "0.33.0"
    assert "| 4 | 16 |" in (tmp_path / "regenerate_throughput.md").read_text()
