"""The drift report of `run_drift`: drift.json, drift.md (`format_table`) and a drift_<view>.png per view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle31.io import atomic_path, atomic_write_json, atomic_write_text, claim_output_dir

REPORT_KIND = "drift"  # the output marker's kind (eagle31.io)
_VIEW_TITLES = {"ttt": "teacher-forced (TTT)", "live": "live drafting"}


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table per view: per (split, drafter, depth) the masses, their head spread, RMS and acceptance."""
    settings = report["settings"]
    targeted = any("target_sink_mass" in r for r in report["results"])  # the target's own sinks, when measured
    masses = ["sink", "context", "own"] + (["target_sink"] if targeted else [])
    target_sinks = [f"target's top {settings['target_sinks']}"] if targeted else []
    header = ["split", "drafter", "k", "sink", "context", "own", *target_sinks, "sink min-max over heads",
              "fed RMS", "out RMS", "norm(out) RMS", "cond. acc."]  # fmt: skip
    parts = [
        f"Attention drift per draft depth k (sink = the first {settings['sink_tokens']} prompt tokens; "
        f"max_new_tokens={settings['max_new_tokens']}, depth={settings['depth']})"
    ]
    for view in ("ttt", "live"):
        rows = [r for r in report["results"] if r["view"] == view]
        if not rows:
            continue
        lines = [f"### {_VIEW_TITLES[view]}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for r in sorted(rows, key=lambda r: (r["split"], r["drafter"])):
            for k in range(len(r["sink_mass"])):
                heads = r["sink_mass_per_head"][k]
                cells = [r["split"], r["drafter"], str(k + 1)]
                cells += [f"{r[f'{name}_mass'][k]:.3f}" for name in masses]
                cells += [f"{min(heads):.3f}-{max(heads):.3f}"]
                cells += [f"{r[name][k]:.3g}" for name in ("fed_rms", "out_rms", "out_norm_rms")]
                cells += ["–" if (rate := r["conditional_acceptance_rate"][k]) is None else f"{rate:.3f}"]
                lines.append("| " + " | ".join(cells) + " |")
        if view == "live":
            lines += ["", "tau (live): " + ", ".join(f"{r['drafter']} / {r['split']} {r['tau']:.3f}" for r in rows)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def plot_view(report: dict[str, Any], view: str, path: str | Path) -> None:
    """PNG of one view, a column per split: attention masses (stacked, a bar per drafter), RMS, acceptance."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend state

    rows = [r for r in report["results"] if r["view"] == view]
    splits = list(dict.fromkeys(r["split"] for r in rows))
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    fig = Figure(figsize=(4.4 * len(splits), 9.5), layout="constrained")
    axes: Any = fig.subplots(3, len(splits), squeeze=False, sharex=True)  # Axes; matplotlib says a bare ndarray
    width = 0.8 / max(len(drafters), 1)
    colors = {"sink": "tab:blue", "context": "tab:gray", "own": "tab:red"}
    hatches = ["", "//", "..", "xx", "--", "oo"]
    for col, split in enumerate(splits):
        mass_ax, rms_ax, acc_ax = axes[:, col]
        for i, drafter in enumerate(drafters):
            r = next((r for r in rows if r["split"] == split and r["drafter"] == drafter), None)
            if r is None:
                continue
            depth = range(1, len(r["sink_mass"]) + 1)
            x = [k - 0.4 + width * (i + 0.5) for k in depth]
            bottom = [0.0] * len(x)
            for name in ("sink", "context", "own"):
                values = r[f"{name}_mass"]
                mass_ax.bar(x, values, width, bottom=bottom, color=colors[name], hatch=hatches[i % len(hatches)],
                            edgecolor="white", label=f"{drafter}: {name}")  # fmt: skip
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            line = rms_ax.plot(depth, r["out_rms"], marker="o", label=f"{drafter}: out (pre-norm)")[0]
            rms_ax.plot(depth, r["fed_rms"], marker="s", ls="--", color=line.get_color(), label=f"{drafter}: fed")
            rates = [float("nan") if a is None else a for a in r["conditional_acceptance_rate"]]
            acc_ax.plot(depth, rates, marker="o", label=drafter)
        mass_ax.set(title=f"{split} — {_VIEW_TITLES[view]}", ylabel="attention mass", yticks=[0, 0.2, 0.4, 0.6, 0.8, 1])
        mass_ax.set_ylim(0, 1.35)  # room for the legend above the bars
        rms_ax.set(ylabel="hidden RMS", yscale="log")
        acc_ax.set(ylabel="conditional acceptance", ylim=(-0.02, 1.02), xlabel="draft depth k")
        for ax in (mass_ax, rms_ax, acc_ax):
            ax.grid(alpha=0.3)
        for ax in (rms_ax, acc_ax):
            ax.legend(fontsize="x-small")
    axes[0, 0].legend(fontsize="x-small", ncol=max(1, len(drafters)), loc="upper center")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write drift.json, drift.md and one PNG per view under `out_dir` (new, empty, or a drift report's)."""
    out = claim_output_dir(out_dir, REPORT_KIND)
    paths = {"json": out / "drift.json", "table": out / "drift.md"}
    atomic_write_json(paths["json"], report)
    atomic_write_text(paths["table"], format_table(report) + "\n")
    for view in dict.fromkeys(r["view"] for r in report["results"]):
        paths[f"plot_{view}"] = out / f"drift_{view}.png"
        plot_view(report, view, paths[f"plot_{view}"])
    return paths
