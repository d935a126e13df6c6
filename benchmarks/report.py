"""Results of the training-step benchmark as files: the JSON of one run and its row in a markdown table.

`update_table` keeps one table between two HTML comment markers of a markdown file (for
example docs/performance.md), one row per device, torch, shape, T, K, checkpointing and precision.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle31.io import atomic_write_text

_TABLE_START = "<!-- benchmark-table:start -->"
_TABLE_END = "<!-- benchmark-table:end -->"
_HEADER = (
    "| date | device | torch | shape | T | K | ckpt | precision | eagle31 step | tokens/s | MFU | peak | "
    "speculators step | tokens/s | peak | speed-up |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(result: dict[str, Any]) -> str:
    """One markdown row of `docs/performance.md`'s table."""
    c = result["config"]

    def side(run: dict | None, mfu: bool) -> list[str]:
        if not run:
            return ["—", "—"] + (["—"] if mfu else []) + ["—"]
        if "error" in run:
            return [run["error"].replace("|", "/"), ""] + ([""] if mfu else []) + [""]
        cells = [f"{run['step_s']:.3f} s", f"{run['tokens_per_s']:,.0f}"]
        if mfu:
            cells.append(f"{run['mfu']:.0%}" if run.get("mfu") else "—")
        cells.append(f"{run['peak_gib']:.2f} GiB" if "peak_gib" in run else "—")
        return cells

    speedup = f"{result['speedup']:.2f}x" if "speedup" in result else "—"
    cells = [
        result["date"], result["device"], result["torch"], c["shape"], str(c["seq_len"]), str(c["ttt_length"]),
        "yes" if c["activation_checkpointing"] else "no", result["precision"],
        *side(result["runs"].get("eagle31"), True), *side(result["runs"].get("speculators"), False), speedup,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def update_table(doc: str | Path, result: dict[str, Any]) -> None:
    """Add `result`'s row to the table between the markers of `doc` (created when missing).

    A row for the same device, torch, shape, T, K, checkpointing and precision is replaced.
    """
    doc = Path(doc)
    text = doc.read_text() if doc.is_file() else "# Performance\n"
    if _TABLE_START not in text:
        text = text.rstrip("\n") + f"\n\n{_TABLE_START}\n{_HEADER}\n{_TABLE_END}\n"
    head, rest = text.split(_TABLE_START, 1)
    body, tail = rest.split(_TABLE_END, 1)
    row = table_row(result)
    key = _row_key(row)
    rows = [r for r in body.strip().splitlines()[2:] if r.startswith("|") and _row_key(r) != key]
    rows.append(row)
    atomic_write_text(doc, f"{head}{_TABLE_START}\n{_HEADER}\n" + "\n".join(rows) + f"\n{_TABLE_END}{tail}")


def _row_key(row: str) -> tuple[str, ...]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return tuple(cells[1:8])  # device .. precision


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return Path(path)
