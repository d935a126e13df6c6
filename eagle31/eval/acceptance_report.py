"""The acceptance report of `run_acceptance`: acceptance.json, acceptance.md (`format_table`), acceptance.png."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle31.io import atomic_path, atomic_write_json, atomic_write_text, claim_output_dir


def format_table(report: dict[str, Any]) -> str:
    """A Markdown table: tau, per-position acceptance rates, cost and speed per (drafter, split)."""
    results = report["results"]
    positions = max((len(r["acceptance_rate"]) for r in results), default=0)
    header = ["drafter", "split", "prompts", "prompt tok", "tau"]
    header += [f"acc@{i + 1}" for i in range(positions)]
    replayed = report["settings"].get("verification") == "replay"  # no target forward ran: the time is drafting's
    header += ["target fwd/tok", "drafting tok/s" if replayed else "tok/s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        rates = [f"{a:.3f}" for a in r["acceptance_rate"]] + [""] * (positions - len(r["acceptance_rate"]))
        cells = [r["drafter"], r["split"], str(r["prompts"]), f"{r['mean_prompt_tokens']:.0f}", f"{r['tau']:.3f}"]
        cells += [*rates, f"{r['target_forwards_per_token']:.3f}", f"{r['tokens_per_second']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    settings = report["settings"]
    mode = {"chain": f"chain, k={settings['k']}", "tree": f"tree {settings['tree']}"}.get(
        settings["mode"], f"drafting={settings['mode']}, k={settings['k']}"
    )
    verified = ", verified from the target's greedy decoding of each prompt" if replayed else ""
    return (
        f"Greedy speculative decoding ({mode}, max_new_tokens={settings['max_new_tokens']}{verified})\n\n"
        + "\n".join(lines)
    )


def plot_acceptance(report: dict[str, Any], path: str | Path) -> None:
    """PNG: acceptance rate per draft position (vLLM's, unconditional); a panel per split."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global backend state

    results = report["results"]
    splits = list(dict.fromkeys(r["split"] for r in results))
    fig = Figure(figsize=(4.2 * len(splits), 3.6), layout="constrained")
    axes: Any = fig.subplots(1, len(splits), sharey=True, squeeze=False)[0]  # Axes; matplotlib says a bare ndarray
    positions = range(1, max(len(r["acceptance_rate"]) for r in results) + 1)
    for ax, split in zip(axes, splits, strict=True):
        for r in (r for r in results if r["split"] == split):
            rates = r["acceptance_rate"]
            ax.plot(positions[: len(rates)], rates, marker="o", label=f"{r['drafter']} (tau {r['tau']:.2f})")
        ax.set(title=split, xlabel="draft position", xticks=positions, ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[0].set_ylabel("acceptance rate")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


REPORT_KIND = "acceptance"  # the output marker's kind (eagle31.io)


def write_report(report: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write acceptance.json, .md and .png under `out_dir` (new, empty, or an acceptance report's)."""
    out = claim_output_dir(out_dir, REPORT_KIND)
    paths = {"json": out / "acceptance.json", "table": out / "acceptance.md", "plot": out / "acceptance.png"}
    atomic_write_json(paths["json"], report)
    atomic_write_text(paths["table"], format_table(report) + "\n")
    plot_acceptance(report, paths["plot"])
    return paths
