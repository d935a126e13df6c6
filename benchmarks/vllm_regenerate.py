"""Regeneration from a real `vllm serve` (the CPU build of vLLM): `data_prep/regenerate.py` with the endpoint
backend against the HF backend, and a server killed mid-run.

    python -m benchmarks.vllm_regenerate                          # both cases, into benchmarks/results/vllm_regenerate
    python -m benchmarks.vllm_regenerate cases=thinking out=/tmp/r

Cases:

* `demo`: the demo target (`vllm serve` with its own chat template), the first turns of the demo corpus's
  held-out conversations.
* `thinking`: a small Llama trained to think (`tests.tiny_targets.save_thinking_target`: Kimi's chat template,
  `<think>...</think>` then the answer), served with `--reasoning-parser kimi_k2` and regenerated with
  `data.chat_template_kwargs={thinking: true, preserve_thinking: true}`, as recipe=kimi_k26 does: the
  server's reasoning path, the reasoning of each turn carried into the next turn's prompt.

For each case `data_prep/regenerate.py` runs twice on the same conversations, greedy: `regenerate.backend=hf` (the
target in-process), and `regenerate.backend=endpoint` against `vllm serve` at `concurrency` requests in flight,
shards of 2 conversations, the server warmed by one short completion first. Once the endpoint run has written its
first shard the server is killed (SIGKILL, its engine with it) and started again on the same port; the run retries
within `regenerate.restart_window_s` and finishes. Then: every conversation is there exactly once (none lost, none
repeated), and each turn is compared with the HF backend's (answer and reasoning). A conversation whose turn differs
is explained by the target's top-2 logit gap where the two replies part (one HF forward over the prompt and the
common prefix); its later turns follow from different prompts and are not compared.

Writes `<out>/vllm_regenerate.json` and `.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.report import write_result_and_table
from benchmarks.vllm_server import VLLMServer

ROOT = Path(__file__).resolve().parents[1]
THINKING = {"thinking": True, "preserve_thinking": True}
NEAR_TIE = 1e-3


def regenerate_cli(args: list[str], log: Path) -> subprocess.Popen:
    """`data_prep/regenerate.py args` in a subprocess, its output in `log` (a pipe would fill while we wait)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}  # this checkout's eagle31, installed or not
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "data_prep" / "regenerate.py"), *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def finish(proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    proc.wait(timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"data_prep/regenerate.py exited {proc.returncode}: {log.read_text()[-3000:]}")


def case_inputs(case: str, work: Path, n: int) -> dict:
    """The target, the source conversations and the recipe arguments of one case."""
    if case == "demo":
        from eagle31.targets.demo import demo_corpus_dir, ensure_demo_target

        target = ensure_demo_target()
        source = demo_corpus_dir() / "heldout.jsonl"
        return {"target": target, "source": source, "args": ["regenerate.max_turns=1"], "reasoning_parser": None}
    if case == "thinking":
        from eagle31.targets.kimi_tokenizer import build_kimi_tokenizer
        from tests.tiny_targets import save_thinking_target, thinking_conversation

        target = save_thinking_target(work / "thinking-target", build_kimi_tokenizer())
        source = work / "thinking.jsonl"
        pairs = [(a, b) for a in range(2, 9) for b in (3, 6)][:n]
        source.write_text("".join(json.dumps({"messages": thinking_conversation(a, b)}) + "\n" for a, b in pairs))
        kwargs = [f"+data.chat_template_kwargs.{k}={str(v).lower()}" for k, v in THINKING.items()]
        return {"target": target, "source": source, "args": kwargs, "reasoning_parser": "kimi_k2"}
    raise ValueError(f"cases: {case!r} is not one of demo, thinking")


def read_output(out_dir: Path) -> tuple[list[dict], dict]:
    """(conversations in shard order, report.json) of a regeneration output directory."""
    records = []
    for shard in sorted((out_dir / "conversations").glob("shard-*.jsonl")):
        records += [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
    return records, json.loads((out_dir / "report.json").read_text())


def turns(record: dict) -> list[dict]:
    return [m for m in record["messages"] if m["role"] == "assistant"]


@torch.no_grad()
def parting_gap(model, tokenizer, record: dict, turn: int, hf_text: str, vllm_text: str, template_kwargs: dict) -> dict:
    """The target's top-2 logit gap at the first token where two replies to the same prompt part."""
    messages = record["messages"]
    index = [i for i, m in enumerate(messages) if m["role"] == "assistant"][turn]
    prompt = tokenizer.apply_chat_template(
        messages[:index], tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    common = os.path.commonprefix([hf_text, vllm_text])
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    reply = tokenizer(common, add_special_tokens=False)["input_ids"][:-1] if common else []  # the last piece may be cut
    logits = model(input_ids=torch.tensor([ids + reply])).logits[0, -1].float()
    top2 = logits.topk(2)
    gap = float(top2.values[0] - top2.values[1])
    return {"common_chars": len(common), "target_top2_gap": gap, "near_tie": gap < NEAR_TIE}


def generated_text(message: dict) -> str:
    """What the target wrote for a turn: its reasoning, the think end, its answer (as the template renders them)."""
    reasoning = message.get("reasoning_content")
    return message["content"] if reasoning is None else f"{reasoning}</think>{message['content']}"


def compare(hf: list[dict], served: list[dict], target: Path, template_kwargs: dict) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    by_source = {r["source"]: r for r in hf}
    sources = [r["source"] for r in served]
    result: dict[str, Any] = {
        "conversations": len(served),
        "missing": sorted(set(by_source) - set(sources)),
        "repeated": sorted({s for s in sources if sources.count(s) > 1}),
        "equal_conversations": 0,
        "turns_compared": 0,
        "turns_equal": 0,
        "differences": [],
    }
    model = tokenizer = None
    for record in served:
        reference = by_source.get(record["source"])
        if reference is None:
            continue
        pairs = list(zip(turns(reference), turns(record)))
        for n, (a, b) in enumerate(pairs):
            result["turns_compared"] += 1
            same = (a["content"], a.get("reasoning_content")) == (b["content"], b.get("reasoning_content"))
            if same:
                result["turns_equal"] += 1
                continue
            if model is None:
                model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
                tokenizer = AutoTokenizer.from_pretrained(target)
            result["differences"].append(
                {
                    "source": record["source"],
                    "turn": n,
                    "later_turns": len(pairs) - n - 1,
                    **parting_gap(
                        model, tokenizer, reference, n, generated_text(a), generated_text(b), template_kwargs
                    ),
                }
            )
            break  # the next turns' prompts differ
        else:
            result["equal_conversations"] += len(turns(reference)) == len(turns(record))
    result["explained"] = all(d["near_tie"] for d in result["differences"])
    return result


def run_case(
    case: str, work: Path, concurrency: int, n: int, max_new_tokens: int, log=print, server_seqs: int | None = None
) -> dict:
    """One case: the HF backend, then the endpoint backend against `vllm serve` (`server_seqs` sequences at a time,
    `concurrency` when None), killed once the first shard is written and started again."""
    (work / case).mkdir(parents=True, exist_ok=True)
    inputs = case_inputs(case, work, n)
    common = [
        "recipe=demo",
        "target.builtin=null",
        f"target.path={inputs['target']}",
        f"output_dir={work / case}",
        f"regenerate.source={inputs['source']}",
        f"regenerate.max_conversations={n}",
        "regenerate.shard_size=2",
        f"regenerate.max_new_tokens={max_new_tokens}",
        "regenerate.on_length=keep",
        *inputs["args"],
    ]
    hf_out, vllm_out = work / case / "hf", work / case / "vllm"
    log(f"{case}: the HF backend")
    started = time.perf_counter()
    hf_log = work / case / "regenerate-hf.log"
    finish(
        regenerate_cli(
            [*common, f"regenerate.output_dir={hf_out}", "regenerate.backend=hf", "regenerate.device=cpu"], hf_log
        ),
        hf_log,
        1800,
    )
    hf_s = time.perf_counter() - started
    with VLLMServer(
        inputs["target"],
        work / case,
        reasoning_parser=inputs["reasoning_parser"],
        max_num_seqs=server_seqs or concurrency,
    ) as server:
        log(f"{case}: vllm serve at {server.url}, {concurrency} requests in flight")
        # paid before the run: a slow first answer holds every shard back (none is written before it), and
        # they would land at once, leaving no mid-run moment to kill the server at
        server.warm_up()
        started = time.perf_counter()
        vllm_log = work / case / "regenerate-vllm.log"
        proc = regenerate_cli(
            [
                *common,
                f"regenerate.output_dir={vllm_out}",
                "regenerate.backend=endpoint",
                f"regenerate.endpoint={server.url}",
                f"regenerate.concurrency={concurrency}",
                "regenerate.restart_window_s=900",
                "regenerate.backoff_s=0.5",
            ],
            vllm_log,
        )
        shards = vllm_out / "conversations"
        while proc.poll() is None and not list(shards.glob("shard-*.jsonl")):
            time.sleep(0.05)
        killed = proc.poll() is None
        if killed:
            server.kill()
        shards_at_kill = len(list(shards.glob("shard-*.jsonl")))  # counted once no answer can come
        if killed:
            log(f"{case}: killed the server after {shards_at_kill} shard(s), starting it again")
            time.sleep(2.0)
            server.start()
        finish(proc, vllm_log, 1800)
        vllm_s = time.perf_counter() - started
    hf, hf_report = read_output(hf_out)
    served, vllm_report = read_output(vllm_out)
    template_kwargs = THINKING if case == "thinking" else {}
    result = {
        "case": case,
        "conversations_in": n,
        "concurrency": concurrency,
        "max_new_tokens": max_new_tokens,
        "reasoning_parser": inputs["reasoning_parser"],
        "hf_seconds": round(hf_s, 1),
        "vllm_seconds": round(vllm_s, 1),
        "server_killed": killed,
        "shards_before_kill": shards_at_kill,
        "server_starts": server.starts,
        "shards": vllm_report.get("shards") or len(list(shards.glob("shard-*.jsonl"))),
        "complete": vllm_report["complete"],
        "reasoning_turns": {"hf": hf_report["reasoning_turns"], "vllm": vllm_report["reasoning_turns"]},
        "turns": {"hf": hf_report["turns"], "vllm": vllm_report["turns"]},
        **compare(hf, served, Path(inputs["target"]), template_kwargs),
    }
    log(
        f"{case}: {result['equal_conversations']}/{result['conversations']} conversations equal to the HF backend's, "
        f"{result['turns_equal']}/{result['turns_compared']} turns; missing {len(result['missing'])}, "
        f"repeated {len(result['repeated'])}"
    )
    return result


def table(result: dict) -> str:
    lines = [
        f"`data_prep/regenerate.py` against `vllm serve` (vLLM {result['settings']['vllm_version']} CPU build), "
        "greedy, the server killed after the first shard and restarted",
        "",
        "| case | reasoning parser | conversations | missing / repeated | equal to the HF backend | turns equal "
        "| turns with reasoning (HF / vLLM) | differences |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cases"]:
        diffs = (
            "; ".join(
                f"{d['source']} turn {d['turn']}: parts after {d['common_chars']} chars, "
                f"top-2 gap {d['target_top2_gap']:.2e}"
                for d in r["differences"]
            )
            or "none"
        )
        lines.append(
            f"| {r['case']} | {r['reasoning_parser'] or 'none'} | {r['conversations']} | "
            f"{len(r['missing'])} / {len(r['repeated'])} | "
            f"{r['equal_conversations']}/{r['conversations']} | {r['turns_equal']}/{r['turns_compared']} | "
            f"{r['reasoning_turns']['hf']} / {r['reasoning_turns']['vllm']} | {diffs} |"
        )
    return "\n".join(lines)


@dataclass
class RegenerateCheckConfig:
    """Arguments of `python -m benchmarks.vllm_regenerate` (`key=value`)."""

    cases: str = "demo,thinking"
    out: str = str(ROOT / "benchmarks" / "results" / "vllm_regenerate")
    concurrency: int = 4  # requests in flight (and the server's --max-num-seqs)
    conversations: int = 12  # per case
    max_new_tokens: int = 48


def main(argv: list[str]) -> int:
    from benchmarks.peer import VLLM_CPU_VERSION
    from eagle31_cli import parse_key_values, run_cli, wants_help

    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        config = parse_key_values(argv, RegenerateCheckConfig)
        with tempfile.TemporaryDirectory() as tmp:
            cases = [
                run_case(c.strip(), Path(tmp), config.concurrency, config.conversations, config.max_new_tokens)
                for c in config.cases.split(",")
                if c.strip()
            ]
        result = {
            "settings": {
                "vllm_version": VLLM_CPU_VERSION,
                "command": "python -m benchmarks.vllm_regenerate " + " ".join(argv),
            },
            "cases": cases,
        }
        write_result_and_table(result, Path(config.out) / "vllm_regenerate.json", table(result) + "\n")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
