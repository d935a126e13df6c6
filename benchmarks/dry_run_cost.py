"""What the dry run of a split sequence costs: the memory trace's three steps (`StepMemory.plane`) of the big
recipes' drafters split 4 ways, with the last rank's keys before its shard traced as they run (every block) and as
the dry run traces them (two blocks of each shape, `QueryTail.blocks` on the meta device), in one process, one after
the other; the bytes must agree.

    python -m benchmarks.dry_run_cost [out=benchmarks/results/dry_run_cost.json] [split=4]
                                      [recipes=kimi_k26,kimi_k26_llama]   # each drafter without its window

Writes the JSON and a Markdown table beside it (CPU seconds of each, and their ratio).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import torch

from benchmarks.report import write_result_and_table
from eagle31.distributed import init_world
from eagle31.memory_trace import StepMemory
from eagle31.plan import plan_run
from eagle31.recipe import load_recipe
from eagle31.sequence_parallel.query_tail import QueryTail

ROOT = Path(__file__).resolve().parent.parent
RECIPES = "kimi_k26,kimi_k26_llama"  # their drafters without a window: the prefix before a shard grows with T^2


def trace_cost(drafter, ttt_length: int, split: int, steady: bool) -> tuple[float, tuple[int, int]]:
    """(CPU seconds, the step's and the features' bytes at 256k) of the three traces the dry run makes."""
    with contextlib.nullcontext() if steady else every_block():
        start = time.process_time()
        memory = StepMemory(drafter, ttt_length, activation_checkpointing=True, dtype=torch.bfloat16, device="cuda",
                            sequence_parallel=split)  # fmt: skip
        bytes_at_256k = memory.at(262144)
        return time.process_time() - start, bytes_at_256k


@contextlib.contextmanager
def every_block():
    """The dry run's traces with every block before a shard run."""
    steady = QueryTail.blocks
    QueryTail.blocks = QueryTail.prefix_blocks
    try:
        yield
    finally:
        QueryTail.blocks = steady


def unwindowed_drafter(recipe: str):
    """(the recipe's drafter without a window, its TTT length)."""
    cfg = load_recipe(ROOT / "recipes", [f"recipe={recipe}", "dry_run=true"])
    return dataclasses.replace(plan_run(cfg, init_world("cpu")).drafter, sliding_window=None), cfg.train.ttt_length


def main(argv: list[str]) -> int:
    args = dict(a.split("=", 1) for a in argv)
    out, split = Path(args.get("out", ROOT / "benchmarks/results/dry_run_cost.json")), int(args.get("split", 4))
    rows = []
    for recipe in args.get("recipes", RECIPES).split(","):
        drafter, K = unwindowed_drafter(recipe)
        every_s, every = trace_cost(drafter, K, split, steady=False)
        steady_s, steady = trace_cost(drafter, K, split, steady=True)
        if steady != every:
            print(f"error: {recipe}: the traced bytes differ with two blocks of each shape", file=sys.stderr)
            return 1
        rows.append(
            {"recipe": recipe, "split": split, "every_block_s": round(every_s, 1),
             "steady_s": round(steady_s, 1), "speedup": round(every_s / steady_s, 1)}
        )  # fmt: skip
        print(rows[-1], flush=True)
    table = [
        "| recipe (no window) | split | every block (CPU s) | two of each shape (CPU s) | speed-up |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(f"| {r['recipe']} | {r['split']} | {r['every_block_s']} | {r['steady_s']} | {r['speedup']}x |")
    write_result_and_table({"rows": rows, "torch": torch.__version__}, out, "\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
