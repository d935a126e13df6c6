"""The side-by-side on a CUDA machine: eagle31 against speculators, both trainers and the measurement on the GPU.

    python -m experiments.side_by_side.gpu <out dir>                 # on the GPU machine (< 8 min, H200)
    python -m experiments.side_by_side.gpu --cpu-smoke <out dir>     # the tiny chat target, 2 steps, on CPU (CI)

Runs through the GPU check's runner (`benchmarks.gpu_check.check_main`: `environment`, then this one
part in its own process with its own budget; `summary.json` and `summary.md` under `<out dir>`). On
the GPU: the demo target, 2 seeds of 400 steps per side (8x the CPU comparison's budget), k = 3,
16 prompts per split. One command of a lent GPU machine may run 10 minutes, so it is a command of
its own, after `python -m benchmarks.gpu_check <out dir>`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.gpu_check import Part, check_main, default_wheels

SIDE_BY_SIDE = Part("side by side", "experiments.side_by_side.gpu:side_by_side", 420)
BUDGET_S = 480.0  # the part's budget and the environment's, within one command of a lent machine
SMOKE_BUDGET_S = 300.0


def side_by_side(smoke: bool, out: Path) -> dict[str, Any]:
    """eagle31 against speculators on equal work (`experiments.side_by_side.study`), both on the part's device: tau per
    split and seed, eagle31 / speculators, and each training's time."""
    from benchmarks.gpu_parts import tiny_chat
    from experiments.side_by_side import study

    work = out / "side_by_side"
    if smoke:
        work.mkdir(parents=True, exist_ok=True)
        chats = work / "chats.jsonl"
        chats.write_text("".join(json.dumps(tiny_chat(i)) + "\n" for i in range(48)))
        keys = dict(device="cpu", **study.SMOKE)
        overrides = [
            "recipe=kimi_k26_mini",
            f"data.source=[{chats}]",
            f"eval.data=[{chats}]",
            "data.max_len=128",
            "data.eval_fraction=0.1",
            "drafter.attention=llama",
            "drafter.draft_vocab_size=128",
            "features.tokens_per_batch=256",
        ]
    else:
        keys = dict(device="cuda", seeds="0,1", max_steps=400, k=3, max_prompts=16, max_new_tokens=48)
        overrides = ["recipe=demo"]
    cfg = study.SideBySideConfig(out=str(work / "result"), runs=str(work / "runs"), **keys)
    summary = study.side_by_side(cfg, overrides, "experiments.side_by_side.gpu")
    ratios = {row["split"]: round(row["ratio"]["speculators"], 3) for row in summary["acceptance"]}
    return {
        "status": "pass",
        "device": cfg.device,
        "detail": "eagle31 / speculators tau: " + ", ".join(f"{split} {r}" for split, r in ratios.items()),
        "acceptance": summary["acceptance"],
        "training": summary["training"],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.side_by_side.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", nargs="?", type=Path, help="output directory (GPU run)")
    parser.add_argument("--cpu-smoke", type=Path, metavar="OUT", help="the tiny variant on CPU")
    parser.add_argument(
        "--wheels", type=Path, help="wheels to install offline (default benchmarks/wheels when present)"
    )
    ns = parser.parse_args(argv)
    outs = [o for o in (ns.out, ns.cpu_smoke) if o is not None]
    if len(outs) != 1:
        print(
            "error: give one output directory: `<out dir>` on a GPU machine, or `--cpu-smoke <out dir>`",
            file=sys.stderr,
        )
        return 2
    smoke = ns.cpu_smoke is not None
    part = SIDE_BY_SIDE if not smoke else Part(SIDE_BY_SIDE.name, SIDE_BY_SIDE.kind, 240)
    budget = SMOKE_BUDGET_S if smoke else BUDGET_S
    return check_main(
        outs[0],
        smoke,
        default_wheels(ns.wheels),
        budget,
        parts=[part],
        mode="cpu-smoke side by side" if smoke else "gpu side by side",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
