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
        result["date"],
        result["device"],
        result["torch"],
        c["shape"],
        str(c["seq_len"]),
        str(c["ttt_length"]),
        "yes" if c["activation_checkpointing"] else "no",
        result["precision"],
        *side(result["runs"].get("eagle31"), True),
        *side(result["runs"].get("speculators"), False),
        speedup,
    ]
    return "| " + " | ".join(cells) + " |"


def update_table(doc: str | Path, result: dict[str, Any]) -> None:
    """Add `result`'s row to the table between the markers of `doc` (created when missing).

    A row for the same device, torch, shape, T, K, checkpointing and precision is replaced.
    """
    head, body, tail = _split_at_markers(doc, _TABLE_START, _TABLE_END)
    row = table_row(result)
    key = _row_key(row)
    rows = [r for r in body.strip().splitlines()[2:] if r.startswith("|") and _row_key(r) != key]
    rows.append(row)
    atomic_write_text(doc, f"{head}{_TABLE_START}\n{_HEADER}\n" + "\n".join(rows) + f"\n{tail}")


def _split_at_markers(doc: str | Path, start: str, end: str) -> tuple[str, str, str]:
    """(text before `start`, between the markers, from `end` on) of `doc`; markers appended when missing."""
    doc = Path(doc)
    text = doc.read_text() if doc.is_file() else "# Performance\n"
    if start not in text:
        text = text.rstrip("\n") + f"\n\n{start}\n{end}\n"
    head, rest = text.split(start, 1)
    body, tail = rest.split(end, 1)
    return head, body, end + tail


def _row_key(row: str) -> tuple[str, ...]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return tuple(cells[1:8])  # device .. precision


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return Path(path)


def write_result_and_table(result: dict[str, Any], path: str | Path, table: str) -> None:
    """A benchmark's `result` as JSON at `path`, its markdown `table` beside it (`.md`), and the table printed."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    atomic_write_text(Path(path).with_suffix(".md"), table)
    print(table)


# ---------------------------------------------------------------------------- the GPU check's summary

_GPU_START = "<!-- gpu-check:start -->"
_GPU_END = "<!-- gpu-check:end -->"


def summary_markdown(summary: dict[str, Any]) -> str:
    """`summary.md` of a GPU check (`benchmarks.gpu_check`)."""
    return f"# GPU check, {summary['date']} ({summary['mode']})\n\n" + gpu_tables(summary)


def put_gpu_table(doc: str | Path, summary: dict[str, Any]) -> None:
    """Replace the GPU check's section of `doc` (between its markers) with `summary`'s tables."""
    head, _, tail = _split_at_markers(doc, _GPU_START, _GPU_END)
    atomic_write_text(doc, f"{head}{_GPU_START}\n{gpu_tables(summary)}{tail}")


def gpu_tables(summary: dict[str, Any]) -> str:
    """The environment line, one row per part, and one row per training-step benchmark run."""
    parts = summary["parts"]
    env = parts.get("environment", {})
    lines = [
        f"Date {summary['date']}; torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
        f"{env.get('gpu', 'no GPU')} (driver {env.get('driver', '?')}), Python {env.get('python', '?')}; "
        f"{summary.get('elapsed_s', '?')} s of a {summary['budget_s']:.0f} s budget; packages installed from "
        f"wheels: {summary['install']['status']}.",
        "",
        "| part | status | seconds | notes |",
        "|---|---|---|---|",
    ]
    for name, part in parts.items():
        lines.append(f"| {name} | {part['status']} | {part.get('seconds', '')} | {_cell(_part_note(part))} |")
    runs = [p for p in parts.values() if "runs" in p]
    if runs:
        lines += [
            "",
            "| shape | T | K | ckpt | eagle31 step | tokens/s | TFLOP/step | MFU | peak | "
            "speculators step | tokens/s | peak | speculators / eagle31 step |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += [_run_row(p) for p in runs]
    return "\n".join(lines) + "\n"


def _part_note(part: dict[str, Any]) -> str:
    if part.get("error"):
        return part["error"]
    notes = [part[k] for k in ("detail", "flash", "mla") if isinstance(part.get(k), str)]
    if "shapes" in part:
        notes.append(", ".join(f"{n} {s['status']}" for n, s in part["shapes"].items()))
    if "checks" in part:
        notes.append(", ".join(n for n, ok in part["checks"].items() if ok) + " ok")
    if "packages" in part:
        notes.append(
            "missing: " + (", ".join(n for n, v in part["packages"].items() if v.startswith("missing")) or "none")
        )
    return "; ".join(notes)


def _run_row(result: dict[str, Any]) -> str:
    c = result["config"]
    ours, peer = result["runs"].get("eagle31", {}), result["runs"].get("speculators", {})
    flops = result.get("flops_per_step")
    shape = c["shape"] + (" parallel" if c.get("parallel") else "")
    cells = [shape, str(c["seq_len"]), str(c["ttt_length"]), "yes" if c["activation_checkpointing"] else "no"]
    cells += _side(ours) + [f"{flops / 1e12:.1f}" if flops else "—", f"{ours['mfu']:.1%}" if ours.get("mfu") else "—"]
    cells.append(f"{ours['peak_gib']:.1f} GiB" if "peak_gib" in ours else "—")
    cells += _side(peer) + [f"{peer['peak_gib']:.1f} GiB" if "peak_gib" in peer else "—"]
    cells.append(f"{result['speedup']:.2f}" if "speedup" in result else "—")
    return "| " + " | ".join(_cell(x) for x in cells) + " |"


def _side(run: dict[str, Any]) -> list[str]:
    if "error" in run:
        return [run["error"], ""]
    if "step_s" not in run:
        return ["—", "—"]
    return [f"{run['step_s']:.3f} s", f"{run['tokens_per_s']:,.0f}"]


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "/")[:300]
