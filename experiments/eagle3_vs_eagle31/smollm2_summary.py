"""EAGLE 3 against EAGLE 3.1 on SmolLM2-135M-Instruct: the tables of `scripts/smollm2_chain.sh`.

    python -m experiments.eagle3_vs_eagle31.smollm2_summary out=experiments/eagle3_vs_eagle31/results/smollm2 \\
        runs=runs/smollm2

Reads the training reports (`<runs>/<variant>-s<seed>/report.json`) and the MT-Bench evaluations under
`out` (`mt_bench/`, `mt_bench_unseen_system/`, `mt_bench_long_history/`, `mt_bench_heldout/`, whichever
exist), and measures the scale of the features the drafters read on the same prompts. Writes `summary.json`
and `results.md` under `out`.

A difference between two variants "holds" when it holds for every pair of seeds: the worst
seed of one beats the best seed of the other. With two seeds that is a weak test, and the
tables say so by giving every seed's value.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle31.errors import ConfigError
from eagle31.io import atomic_write_json, atomic_write_text
from eagle31_cli import parse_key_values, run_cli, wants_help

ROOT = Path(__file__).resolve().parents[2]
PROBES = {
    "mt_bench": "MT-Bench",
    "mt_bench_unseen_system": "MT-Bench under an unseen system prompt",
    "mt_bench_long_history": "MT-Bench after a long history",
    "mt_bench_heldout": "ShareGPT held out (training distribution)",
}
NAMES = {"eagle3": "EAGLE 3", "fc_norm": "fc_norm only", "norm_output": "norm_output only", "eagle31": "EAGLE 3.1"}


@dataclass
class SummaryConfig:
    out: str = "experiments/eagle3_vs_eagle31/results/smollm2"
    runs: str = "runs/smollm2"
    trained_len: int = 512  # data.max_len of the drafters: feature scale is reported below and beyond it
    scale_prompts: int = 8  # MT-Bench questions (one per category first) whose features are measured


def parse_label(label: str) -> tuple[str, int]:
    """`eagle31-s0` -> ("eagle31", 0)."""
    variant, sep, seed = label.rpartition("-s")
    if not sep or not seed.isdigit() or variant not in NAMES:
        raise ConfigError(f"drafter label {label!r} is not <variant>-s<seed> with a variant of {list(NAMES)}")
    return variant, int(seed)


def training_rows(runs: Path, labels: list[str]) -> list[dict[str, Any]]:
    rows = []
    for label in labels:
        report = json.loads((runs / label / "report.json").read_text())
        variant, seed = parse_label(label)
        keys = ("tau_sim", "acc", "eval_loss", "train_time_s", "steps", "tokens_seen")
        rows.append({"variant": variant, "seed": seed, **{k: report.get(k) for k in keys}})
    return rows


def acceptance_rows(report: dict[str, Any], probe: str) -> list[dict[str, Any]]:
    """Per (mode, variant): tau over all questions for every seed, and per-position rates averaged over seeds."""
    by: dict[tuple[str, str], list[dict]] = {}
    for r in report["results"]:
        if r["split"] == "all":
            by.setdefault((r["mode"], parse_label(r["drafter"])[0]), []).append(r)
    rows = []
    for (mode, variant), results in by.items():
        n = len(results)
        positions = len(results[0]["acceptance_rate"])
        rows.append(
            {
                "probe": probe,
                "mode": mode,
                "variant": variant,
                "seeds": [parse_label(r["drafter"])[1] for r in results],
                "tau": [r["tau"] for r in results],
                "tau_mean": sum(r["tau"] for r in results) / n,
                "acceptance_rate_mean": [sum(r["acceptance_rate"][i] for r in results) / n for i in range(positions)],
                "conditional_acceptance_rate_mean": [
                    sum(r["conditional_acceptance_rate"][i] for r in results) / n for i in range(positions)
                ],
                "prompts": results[0]["prompts"],
                "mean_prompt_tokens": results[0]["mean_prompt_tokens"],
            }
        )
    return rows


def category_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Per (mode, variant, category): tau averaged over seeds."""
    by: dict[tuple[str, str, str], list[float]] = {}
    for r in report["results"]:
        by.setdefault((r["mode"], parse_label(r["drafter"])[0], r["split"]), []).append(r["tau"])
    return [{"mode": m, "variant": v, "category": c, "tau_mean": sum(t) / len(t)} for (m, v, c), t in by.items()]


def verdict(a: list[float], b: list[float]) -> str:
    """How tau values `a` (EAGLE 3.1's seeds) compare with `b` (another variant's)."""
    if len(a) < 2 or len(b) < 2:
        return "one seed: no spread to compare with"
    if min(a) > max(b):
        return "higher, outside the seed spread"
    if max(a) < min(b):
        return "lower, outside the seed spread"
    return "within the seed spread"


def feature_scale(
    target_dir: str, history: Path | None, history_tokens: int, drafters: dict[str, str], cfg: SummaryConfig
) -> dict[str, Any]:
    """RMS over the hidden dimension of each aux layer's state and of lm_head's input, on MT-Bench prompts,
    and how much of each drafter's fused feature comes from each aux layer.

    Per prompt set: RMS at position 0, and the median RMS of the other positions below
    `trained_len` and from `trained_len` on (the long-history prompts reach past it).
    Per drafter: the RMS of `fc`'s output restricted to each aux layer's input columns
    (after `fc_norm` where the drafter has it), median over positions 1.. of the MT-Bench
    prompts: whether a drafter without `fc_norm` learnt to weigh the layers evenly anyway.
    """
    import torch
    from transformers import AutoTokenizer

    from eagle31.config import DrafterConfig
    from eagle31.convert import load_drafter
    from eagle31.data.sources import Tally, read_conversations, read_mt_bench
    from eagle31.eval.acceptance import render
    from eagle31.eval.mtbench import long_histories, select_questions
    from eagle31.target import TargetFeatures, load_target, load_target_config

    aux_ids = DrafterConfig.from_target_config(load_target_config(target_dir)).aux_layer_ids
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = load_target(target_dir, torch.device("cpu"), dtype=torch.float32)
    questions = select_questions(read_mt_bench("mtbench:", Tally()), 1)[: cfg.scale_prompts]
    sets = {"MT-Bench turn 1": [[{"role": "user", "content": q.turns[0]}] for q in questions]}
    if history is not None:
        conversations = list(read_conversations([str(history)], Tally()))
        histories = long_histories(tokenizer, conversations, len(questions), history_tokens)
        sets[f"after >= {history_tokens} tokens of history"] = [
            h + [{"role": "user", "content": q.turns[0]}] for h, q in zip(histories, questions)
        ]
    names = [f"aux layer {i}" for i in aux_ids] + ["final"]
    out: dict[str, Any] = {"aux_layer_ids": list(aux_ids), "trained_len": cfg.trained_len, "sets": {}, "fc_share": {}}
    loaded = {label: load_drafter(path).eval() for label, path in drafters.items()}
    shares: dict[str, list[list[float]]] = {label: [] for label in loaded}  # per drafter: per prompt, per aux layer
    with TargetFeatures(model, aux_ids) as features, torch.no_grad():
        for set_name, chats in sets.items():
            rms: dict[str, dict[str, list[float]]] = {n: {"first": [], "below": [], "beyond": []} for n in names}
            for messages in chats:
                aux, final = features.capture(torch.tensor([render(tokenizer, messages)]))  # [1, T, n*Ht], [1, T, Ht]
                for name, h in zip(names, list(aux[0].chunk(len(aux_ids), dim=-1)) + [final[0]]):
                    values = h.float().pow(2).mean(-1).sqrt().tolist()  # [T]
                    rms[name]["first"].append(values[0])
                    rms[name]["below"] += values[1 : cfg.trained_len]
                    rms[name]["beyond"] += values[cfg.trained_len :]
                if set_name == "MT-Bench turn 1":
                    for label, drafter in loaded.items():
                        shares[label].append(fc_share(drafter, aux[0, 1:]))
            out["sets"][set_name] = {
                name: {part: statistics.median(v) if v else None for part, v in parts.items()}
                for name, parts in rms.items()
            }
    out["fc_share"] = {
        label: [statistics.mean(p[i] for p in per) for i in range(len(aux_ids))] for label, per in shares.items()
    }
    return out


def fc_share(drafter, aux) -> list[float]:
    """aux [T, n*Ht] -> per aux layer, its share of the summed RMS of fc's output from each layer's columns."""
    import torch

    chunks = aux.float().chunk(drafter.config.num_aux, dim=-1)
    if drafter.fc_norm is not None:
        chunks = [norm(c) for norm, c in zip(drafter.fc_norm, chunks)]
    weights = drafter.fc.weight.float().chunk(drafter.config.num_aux, dim=-1)  # [H, Ht] each
    rms = [torch.median((c @ w.T).pow(2).mean(-1).sqrt()).item() for c, w in zip(chunks, weights)]
    return [r / sum(rms) for r in rms]


def summarize(cfg: SummaryConfig, target_dir: str | None) -> dict[str, Any]:
    out, runs = ROOT / cfg.out, ROOT / cfg.runs
    reports = {
        p: json.loads((out / p / "mt_bench.json").read_text()) for p in PROBES if (out / p / "mt_bench.json").is_file()
    }
    if "mt_bench" not in reports:
        raise ConfigError(f"{out / 'mt_bench' / 'mt_bench.json'}: not found; run scripts/smollm2_chain.sh first")
    labels = list(reports["mt_bench"]["settings"]["drafters"])
    acceptance = [row for probe, report in reports.items() for row in acceptance_rows(report, probe)]
    long_settings = reports.get("mt_bench_long_history", {}).get("settings", {})
    history = long_settings.get("history")
    import torch

    summary = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "settings": {
            p: {k: v for k, v in r["settings"].items() if k not in ("drafters", "target")} for p, r in reports.items()
        },
        "training": training_rows(runs, labels),
        "acceptance": acceptance,
        "categories": category_rows(reports["mt_bench"]),
    }
    if target_dir is not None:
        seed0 = {
            label: str(ROOT / path)
            for label, path in reports["mt_bench"]["settings"]["drafters"].items()
            if label.endswith("-s0")
        }
        summary["feature_scale"] = feature_scale(
            target_dir, ROOT / history if history else None, long_settings.get("history_tokens") or 0, seed0, cfg
        )
    return summary


def _cell(row: dict[str, Any]) -> str:
    return f"{row['tau_mean']:.3f} ({', '.join(f'{t:.3f}' for t in row['tau'])})"


def format_results(summary: dict[str, Any]) -> str:
    rows = {(a["probe"], a["mode"], a["variant"]): a for a in summary["acceptance"]}
    variants = [v for v in NAMES if any(key[2] == v for key in rows)]
    modes = list(dict.fromkeys(a["mode"] for a in summary["acceptance"]))
    out = ["Training (teacher-forced on the held-out part of the prepared data):", ""]
    out += ["| variant | seed | steps | tau_sim | eval loss | train s |", "|---|---|---|---|---|---|"]
    for t in summary["training"]:
        out.append(
            f"| {NAMES[t['variant']]} | {t['seed']} | {t['steps']} | {t['tau_sim']:.3f} | {t['eval_loss']:.3f} | "
            f"{t['train_time_s']:.0f} |"
        )
    out += [
        "",
        "Acceptance length tau, mean over seeds (each seed's value in brackets); "
        "last column: EAGLE 3.1 against EAGLE 3:",
        "",
    ]
    header = ["probe", "mode", "prompt tok"] + [NAMES[v] for v in variants] + ["3.1 vs 3"]
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for probe in PROBES:
        for mode in modes:
            present = {v: rows[(probe, mode, v)] for v in variants if (probe, mode, v) in rows}
            if not present:
                continue
            first = next(iter(present.values()))
            cells = [PROBES[probe], mode, f"{first['mean_prompt_tokens']:.0f}"]
            cells += [_cell(present[v]) if v in present else "" for v in variants]
            both = "eagle31" in present and "eagle3" in present
            cells.append(
                f"{present['eagle31']['tau_mean'] - present['eagle3']['tau_mean']:+.3f}, "
                f"{verdict(present['eagle31']['tau'], present['eagle3']['tau'])}"
                if both
                else ""
            )
            out.append("| " + " | ".join(cells) + " |")
    deepest = max(
        modes, key=lambda m: len(next(a for a in summary["acceptance"] if a["mode"] == m)["acceptance_rate_mean"])
    )
    positions = len(next(a for a in summary["acceptance"] if a["mode"] == deepest)["acceptance_rate_mean"])
    out += [
        "",
        f"Conditional acceptance rate per draft position ({deepest}, mean over seeds): "
        "the chance that position i is accepted when 1..i-1 were:",
        "",
    ]
    out += [
        "| probe | variant | " + " | ".join(f"@{i + 1}" for i in range(positions)) + " |",
        "|" + "---|" * (2 + positions),
    ]
    for probe in PROBES:
        for v in variants:
            if (probe, deepest, v) in rows:
                rates = rows[(probe, deepest, v)]["conditional_acceptance_rate_mean"]
                out.append(f"| {PROBES[probe]} | {NAMES[v]} | " + " | ".join(f"{r:.3f}" for r in rates) + " |")
    out += ["", "MT-Bench tau per category (mean over seeds):", ""]
    categories = sorted({c["category"] for c in summary["categories"]} - {"all"})

    out += ["| mode | variant | all | " + " | ".join(categories) + " |", "|" + "---|" * (3 + len(categories))]
    cats = {(c["mode"], c["variant"], c["category"]): c["tau_mean"] for c in summary["categories"]}
    for mode in modes:
        for v in variants:
            if (mode, v, "all") in cats:
                out.append(
                    f"| {mode} | {NAMES[v]} | "
                    + " | ".join(f"{cats.get((mode, v, c), float('nan')):.3f}" for c in ["all"] + categories)
                    + " |"
                )
    if "feature_scale" in summary:
        out += ["", format_feature_scale(summary["feature_scale"])]
    return "\n".join(out)


def format_feature_scale(scale: dict[str, Any]) -> str:
    n = scale["trained_len"]
    lines = [
        "RMS of the target's states over the hidden dimension: "
        f"position 0 / median of positions 1..{n - 1} / median from {n} on:",
        "",
    ]
    names = list(next(iter(scale["sets"].values())))
    lines += ["| prompts | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    for set_name, values in scale["sets"].items():
        cells = [
            " / ".join("–" if values[m][p] is None else f"{values[m][p]:.1f}" for p in ("first", "below", "beyond"))
            for m in names
        ]
        lines.append(f"| {set_name} | " + " | ".join(cells) + " |")
    if scale.get("fc_share"):
        layers = [f"aux layer {i}" for i in scale["aux_layer_ids"]]
        lines += [
            "",
            "Share of each aux layer in the fused feature `fc(...)` "
            "(RMS of its columns' output, MT-Bench turn-1 prompts, positions 1..):",
            "",
        ]
        lines += ["| drafter | " + " | ".join(layers) + " |", "|" + "---|" * (1 + len(layers))]
        for label, share in scale["fc_share"].items():
            lines.append(f"| {label} | " + " | ".join(f"{x:.2f}" for x in share) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        from eagle31.targets.smollm2 import ensure_smollm2_target

        cfg = parse_key_values(argv, SummaryConfig)
        summary = summarize(cfg, str(ensure_smollm2_target()))
        out = ROOT / cfg.out
        atomic_write_json(out / "summary.json", summary)
        table = format_results(summary)
        atomic_write_text(out / "results.md", table + "\n")
        print(table)
        print(f"\nwrote {out / 'summary.json'}, {out / 'results.md'}")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
