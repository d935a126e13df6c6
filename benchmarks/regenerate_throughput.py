"""Regeneration throughput against a server with a fixed per-request latency.

    python -m benchmarks.regenerate_throughput                       # concurrency 1, 16, 64, 256; latency 8 s
    python -m benchmarks.regenerate_throughput concurrency=1,4 latency_s=0.05 waves=2 out=/tmp/rt

The server is tests/data/vllm_like_server.py under the vLLM 0.33.0 venv (vLLM's own request
validation and response models, the Kimi chat template and vLLM's kimi_k2 reasoning parser), each
reply sent `latency_s` seconds after its request arrived (the server's processing included), as
an engine decoding a reply would. For each concurrency `c`,
`regenerate` (`EndpointBackend`, `c` requests in flight) answers `c * waves / 2` two-turn
conversations (`c * waves` requests) into a fresh directory, shards of 64; the ideal is `c /
latency_s` requests per second, and the ratio to it is the efficiency (its goal at 256: >= 0.9). The
other requests wait up to a second for the first one's answer (a server that refuses requests stops
the run after one), a fixed cost per run: `waves` sets how much it weighs.

Writes `<out>/regenerate_throughput.json` and `.md` (default benchmarks/results/).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import write_result_and_table
from eagle31.data.regenerate.backends import EndpointBackend
from eagle31.data.regenerate.core import Settings
from eagle31.data.regenerate.pool import regenerate
from eagle31.data.regenerate.shards import prepare_output, write_report
from eagle31.data.sources import Conversation, Tally

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {
    "concurrency": "1,16,64,256",
    "latency_s": "8.0",
    "waves": "12",
    "out": str(ROOT / "benchmarks" / "results"),
    "python": "",
    "reasoning_parser": "kimi_k2",
}
THINKING = {"thinking": True, "preserve_thinking": True}


def measure(url: str, concurrency: int, latency_s: float, waves: int, work: Path) -> dict:
    n_conversations = max(1, concurrency * waves // 2)
    conversations = [
        Conversation(
            [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "and then?"},
                {"role": "assistant", "content": "y"},
            ],
            where=str(i),
        )
        for i in range(n_conversations)
    ]
    settings = Settings(max_new_tokens=64, shard_size=64, chat_template_kwargs=THINKING)
    out = work / f"c{concurrency}"
    prepare_output(out, settings, {"sources": ["benchmark"]})
    backend = EndpointBackend(url, settings, concurrency=concurrency, timeout_s=60 + 10 * latency_s)
    started, cpu = time.perf_counter(), time.process_time()
    regenerate(conversations, backend, out, settings)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    report = write_report(out, Tally(), n_conversations)
    assert report["complete"] and report["turns"] == 2 * n_conversations, report
    requests = report["turns"]
    ideal = concurrency / latency_s
    return {
        "concurrency": concurrency,
        "requests": requests,
        "seconds": round(seconds, 3),
        "requests_per_s": round(requests / seconds, 2),
        "ideal_requests_per_s": round(ideal, 2),
        "efficiency": round(requests / seconds / ideal, 4),
        "client_cpu_ms_per_request": round(1000 * cpu / requests, 3),  # this process (the server is another)
    }


def table(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"Regeneration throughput, per-request latency {s['latency_s']} s, {s['waves']} waves of requests "
        f"(vLLM {s['server']['vllm']} protocol server, {s['server']['cpu_count']} CPUs)",
        "",
        "| concurrency | requests | seconds | requests/s | ideal (c / latency) | efficiency "
        "| client CPU ms / request |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['concurrency']} | {r['requests']} | {r['seconds']:.2f} | {r['requests_per_s']:.1f} | "
            f"{r['ideal_requests_per_s']:.1f} | {r['efficiency']:.3f} | "
            f"{r['client_cpu_ms_per_request']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = dict(DEFAULTS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in DEFAULTS:
            print(f"error: expected key=value with key in {sorted(DEFAULTS)}, got {arg!r}", file=sys.stderr)
            return 2
        args[key] = value
    from benchmarks.peer import peers_dir
    from tests.data.vllm_like_server import VLLMLikeServer

    python = Path(args["python"]) if args["python"] else peers_dir() / "vllm-0.33.0" / "bin" / "python"
    if not python.is_file():
        print(f"error: no vLLM 0.33.0 interpreter at {python}: run `bash .ci/peer_venvs.sh 0.33.0`", file=sys.stderr)
        return 2
    concurrencies = [int(c) for c in args["concurrency"].split(",")]
    latency_s, waves = float(args["latency_s"]), int(args["waves"])
    from eagle31.targets.kimi_tokenizer import build_kimi_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_kimi_tokenizer().save_pretrained(work / "tokenizer")
        spec = {
            "tokenizer": str(work / "tokenizer"),
            "model": "kimi-k2.6-test",
            "max_model_len": 4096,
            "reasoning_parser": args["reasoning_parser"] or None,
            "latency_s": latency_s,
        }
        with VLLMLikeServer(python, spec, work) as server:
            results = []
            for c in concurrencies:
                results.append(measure(server.url, c, latency_s, waves, work))
                print(json.dumps(results[-1]), flush=True)
    vllm = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "settings": {
            "latency_s": latency_s,
            "waves": waves,
            "max_new_tokens": 64,
            "shard_size": 64,
            "reasoning_parser": args["reasoning_parser"] or None,
            "server": {"vllm": vllm, "cpu_count": os.cpu_count(), "python": platform.python_version()},
            "command": "python -m benchmarks.regenerate_throughput " + " ".join(argv),
        },
        "results": results,
    }
    write_result_and_table(result, Path(args["out"]) / "regenerate_throughput.json", table(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
