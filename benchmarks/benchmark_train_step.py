"""Time one full training step of the drafter (forward, backward, AdamW), optionally against `speculators`.

    python -m benchmarks.benchmark_train_step shape=kimi_k26 T=4096 ttt=7 peer=speculators
    python -m benchmarks.benchmark_train_step shape=kimi_k26 T=65536 ttt=7 ckpt=true
    python -m benchmarks.benchmark_train_step shape=tiny T=2048 ttt=7 peer=speculators threads=1   # CPU-sized

Run from the repository root. Keys: shape (a recipe with a shipped target config — kimi_k26,
llama31_8b, qwen3_8b — or tiny), T, ttt, peer (none | speculators), ckpt (activation
checkpointing per TTT step), attention, precision, device, compile, peer_attention, warmup,
repeats, memory, peak_tflops, threads (CPU), seed; out= the JSON file (default
benchmarks/results/<name>.json); doc= the markdown file whose table gets the row (default
docs/performance.md; doc=none to skip).
What is measured and how: benchmarks/train_step.py and benchmarks/measure.py.
"""

import json
import sys
from pathlib import Path

from benchmarks.measure import run_benchmark
from benchmarks.report import table_row, update_table, write_result
from benchmarks.train_step import BenchConfig
from eagle31.distributed import close_world
from eagle31.errors import ConfigError
from eagle31_cli import wants_help

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    paths = {"out": None, "doc": str(ROOT / "docs" / "performance.md")}
    rest = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key in paths:
            paths[key] = value
        else:
            rest.append(arg)
    try:
        bench = BenchConfig.from_args(rest)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(bench, log=lambda line: print(line, file=sys.stderr))
    finally:
        close_world()  # the one-process group FSDP2 ran in on CUDA
    out = write_result(result, paths["out"] or ROOT / "benchmarks" / "results" / f"{result['name']}.json")
    if paths["doc"] != "none":
        update_table(paths["doc"], result)
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=2))
    print(table_row(result))
    print(f"wrote {out}" + ("" if paths["doc"] == "none" else f" and a row of {paths['doc']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
