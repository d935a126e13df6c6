"""EAGLE 3 against EAGLE 3.1 on the demo target: train both, evaluate on every split.

    python -m experiments.eagle3_vs_eagle31.demo                   # the comparison of docs/results/eagle3_vs_eagle31.md
    python -m experiments.eagle3_vs_eagle31.demo dry_run=true      # print the trainings and measurements, run nothing
    python -m experiments.eagle3_vs_eagle31.demo seeds=0 ttt_lengths=5 ks=3 max_prompts=8 out=/tmp/cmp \\
        runs=/tmp/cmp/runs
    python -m experiments.eagle3_vs_eagle31.demo --smoke out=/tmp/cmp runs=/tmp/cmp/runs   # tiny sizes (also SMOKE=1)

For every seed and TTT length it trains two drafters with `train/main.py`'s pipeline
(`eagle31.pipeline.run`, `recipe=demo`) and the same data (one prepared directory), seed, steps
and settings; they differ only in the two EAGLE 3.1 switches (`drafter.fc_norm`,
`drafter.norm_output`). Then, per TTT length and per k, one acceptance run
(`experiments.harness.measure_drafters`: the target decodes each prompt once, every drafter is
verified from that decoding) measures all of them on every split. Resumable: a finished training
is skipped, a killed one continues from its checkpoint, and a measurement of the same weights with
the same settings is kept. After `--`: recipe overrides of every training. Writes under `out`:
`commands.sh` (what ran), `ttt<T>-k<k>/` (each measurement's JSON, table and plot),
`summary.json`, `results.md` and `comparison.png`.

Keys: out, runs (training run directories), seeds, ttt_lengths, ks (comma lists), max_steps,
max_prompts (per split), max_new_tokens, splits (of the demo corpus), threads (OpenMP threads:
oversubscribed on a shared 2-core machine they made decoding ten times slower), dry_run.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from eagle31.io import atomic_path
from experiments.harness import ROOT, log_command, measure_drafters, study_main, train_missing, write_summary

# The one difference between the drafters: EAGLE 3 is EAGLE 3.1 with both switches off;
# the two single-switch variants are the ablation (variants=eagle3,fc_norm,norm_output,eagle31).
VARIANTS = {
    "eagle3": ["drafter.fc_norm=false", "drafter.norm_output=false"],
    "fc_norm": ["drafter.norm_output=false"],
    "norm_output": ["drafter.fc_norm=false"],
    "eagle31": [],
}
NAMES = {"eagle3": "EAGLE 3", "fc_norm": "+fc_norm only", "norm_output": "+norm_output only", "eagle31": "EAGLE 3.1"}
COLORS = {"eagle3": "tab:orange", "fc_norm": "tab:green", "norm_output": "tab:purple", "eagle31": "tab:blue"}
SMOKE = dict(seeds="0", ttt_lengths="2", ks="2", max_steps=2, max_prompts=1, max_new_tokens=8, splits="heldout")


@dataclass
class CompareConfig:
    out: str = "experiments/eagle3_vs_eagle31/results/demo"
    runs: str = "runs/compare"
    variants: str = "eagle3,eagle31"  # of VARIANTS
    seeds: str = "0,1"
    ttt_lengths: str = "5,7"  # train.ttt_length of the drafters (5: the demo recipe's)
    ks: str = "3,5,7"  # draft tokens per round in the evaluation; every drafter at every k
    max_steps: int = 300
    max_prompts: int = 100
    max_new_tokens: int = 64
    splits: str = "heldout,other_system,long_prompt"
    threads: int = 1
    dry_run: bool = False

    def __post_init__(self) -> None:
        for name in ("seeds", "ttt_lengths", "ks"):
            getattr(self, name + "_list")  # raises on a bad list
        for name in ("max_steps", "max_prompts", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if not self.splits_list:
            raise ConfigError("splits= names no split")
        unknown = [v for v in self.variants_list if v not in VARIANTS]
        if unknown or not self.variants_list:
            raise ConfigError(f"variants must list some of {', '.join(VARIANTS)}, got {self.variants!r}")

    def _ints(self, name: str) -> list[int]:
        try:
            values = [int(v) for v in getattr(self, name).split(",") if v.strip()]
        except ValueError:
            raise ConfigError(
                f"{name} must be a comma-separated list of integers, got {getattr(self, name)!r}"
            ) from None
        if not values or (name != "seeds" and min(values) < 1):
            raise ConfigError(f"{name} must list positive integers, got {getattr(self, name)!r}")
        return values

    seeds_list = property(lambda self: self._ints("seeds"))
    ttt_lengths_list = property(lambda self: self._ints("ttt_lengths"))
    ks_list = property(lambda self: self._ints("ks"))
    splits_list = property(lambda self: [s.strip() for s in self.splits.split(",") if s.strip()])
    variants_list = property(lambda self: [v.strip() for v in self.variants.split(",") if v.strip()])


# ---------------------------------------------------------------------------- trainings and measurements


def run_name(variant: str, ttt: int, seed: int) -> str:
    return f"{variant}-ttt{ttt}-s{seed}"


def parse_run_name(name: str) -> tuple[str, int, int]:
    """`eagle31-ttt5-s0` -> ("eagle31", 5, 0)."""
    variant, ttt, seed = name.split("-")
    return variant, int(ttt.removeprefix("ttt")), int(seed.removeprefix("s"))


def training_overrides(cfg: CompareConfig, overrides: list[str], variant: str, ttt: int, seed: int) -> list[str]:
    """The demo recipe, the user's `overrides`, then only seed, TTT length, steps and the variant's switches changed."""
    return [
        "recipe=demo",
        *overrides,
        f"output_dir={cfg.runs}/{run_name(variant, ttt, seed)}",
        f"data.prepared_dir={cfg.runs}/data",  # prepared once: every drafter reads the same tokens
        f"seed={seed}",
        f"train.ttt_length={ttt}",
        f"train.max_steps={cfg.max_steps}",
        "resume=auto",  # a killed training continues from its last checkpoint
        "eval.enabled=false",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
        *VARIANTS[variant],
    ]


def trainings(cfg: CompareConfig, overrides: list[str]) -> dict[str, list[str]]:
    """run name -> its recipe overrides, in the order they train."""
    return {
        run_name(variant, ttt, seed): training_overrides(cfg, overrides, variant, ttt, seed)
        for ttt in cfg.ttt_lengths_list
        for seed in cfg.seeds_list
        for variant in cfg.variants_list
    }


def measurement_recipe(cfg: CompareConfig, overrides: list[str]):
    """The recipe the measurements read: the demo target, its corpus' `splits` as `eval.data`."""
    from eagle31.recipe import load_recipe

    return load_recipe(
        ROOT / "recipes", ["recipe=demo", *overrides, f"eval.data=[{','.join(f'demo:{s}' for s in cfg.splits_list)}]"]
    )


def drafters(cfg: CompareConfig, ttt: int) -> dict[str, Path]:
    """label -> drafter directory of every drafter of one TTT length."""
    return {
        run_name(v, ttt, s): Path(cfg.runs) / run_name(v, ttt, s) / "drafter"
        for v in cfg.variants_list
        for s in cfg.seeds_list
    }


def measurement_folder(ttt: int, k: int) -> str:
    return f"ttt{ttt}-k{k}"


def describe_plan(cfg: CompareConfig, overrides: list[str]) -> str:
    """What a run does, in order: each training as the `train/main.py` command of the same run, then each
    measurement."""
    lines = [
        f"OMP_NUM_THREADS={cfg.threads} python train/main.py " + shlex.join(o)
        for o in trainings(cfg, overrides).values()
    ]
    for ttt in cfg.ttt_lengths_list:
        for k in cfg.ks_list:
            lines.append(
                f"measure {Path(cfg.out) / measurement_folder(ttt, k)}: k={k}, {', '.join(drafters(cfg, ttt))} "
                f"on {', '.join(cfg.splits_list)}"
            )
    return "\n".join(lines)


def compare(cfg: CompareConfig, overrides: list[str], command: str) -> None:
    """Train what is missing, measure every TTT length at every k, summarise (`dry_run`: print the plan only)."""
    if cfg.dry_run:
        print(describe_plan(cfg, overrides))
        return
    import torch

    from eagle31.recipe import load_recipe
    from eagle31.targets.demo import demo_corpus_dir, ensure_demo_target

    torch.set_num_threads(cfg.threads)
    out, runs = Path(cfg.out), Path(cfg.runs)
    recipes = {
        name: load_recipe(ROOT / "recipes", o) for name, o in trainings(cfg, overrides).items()
    }  # checked before any work
    recipe = measurement_recipe(cfg, overrides)
    out.mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    train_missing(recipes, runs, out)
    for ttt in cfg.ttt_lengths_list:
        for k in cfg.ks_list:
            measure_drafters(
                drafters(cfg, ttt),
                recipe,
                k=k,
                max_new_tokens=cfg.max_new_tokens,
                max_prompts=cfg.max_prompts,
                out=out,
                report_folder=measurement_folder(ttt, k),
            )
    summary = summarize(cfg)
    summary["feature_scale"] = feature_scale(
        cfg, ensure_demo_target(), demo_corpus_dir()
    )  # the target is built once per machine (cached)
    table = format_results(summary)
    write_summary(out, summary, table)
    plot_results(summary, out / "comparison.png")
    print(table)
    print(f"\nwrote {out / 'summary.json'}, {out / 'results.md'}, {out / 'comparison.png'}")


# ---------------------------------------------------------------------------- results


def summarize(cfg: CompareConfig) -> dict:
    """Every run's report and every evaluation, with the mean over seeds per (TTT, k, split, variant)."""
    training = []
    for ttt in cfg.ttt_lengths_list:
        for variant in cfg.variants_list:
            for seed in cfg.seeds_list:
                report = json.loads((Path(cfg.runs) / run_name(variant, ttt, seed) / "report.json").read_text())
                keys = ("tau_sim", "acc", "eval_loss", "train_time_s", "steps", "tokens_seen")
                training.append({"variant": variant, "ttt_length": ttt, "seed": seed, **{k: report[k] for k in keys}})
    acceptance = []
    for ttt in cfg.ttt_lengths_list:
        for k in cfg.ks_list:
            results = json.loads((Path(cfg.out) / measurement_folder(ttt, k) / "acceptance.json").read_text())[
                "results"
            ]
            for split in cfg.splits_list:
                for variant in cfg.variants_list:
                    rows = [r for r in results if r["split"] == split and parse_run_name(r["drafter"])[0] == variant]
                    acceptance.append(mean_over_seeds(rows, ttt, k, split, variant))
    import torch

    return {
        "settings": asdict(cfg),
        "date": datetime.date.today().isoformat(),
        "machine": f"{cpu_name()}, {os.cpu_count()} cores, {cfg.threads} thread(s) per process",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "training": training,
        "acceptance": acceptance,
    }


def mean_over_seeds(rows: list[dict], ttt: int, k: int, split: str, variant: str) -> dict:
    n = len(rows)
    return {
        "ttt_length": ttt,
        "k": k,
        "split": split,
        "variant": variant,
        "seeds": [parse_run_name(r["drafter"])[2] for r in rows],
        "tau": [r["tau"] for r in rows],
        "tau_mean": sum(r["tau"] for r in rows) / n,
        "acceptance_rate_mean": [sum(r["acceptance_rate"][i] for r in rows) / n for i in range(k)],
        "prompts": rows[0]["prompts"],
        "mean_prompt_tokens": rows[0]["mean_prompt_tokens"],
    }


def feature_scale(cfg: CompareConfig, target: Path, corpus: Path, trained_len: int = 384) -> dict:
    """RMS of the target features the drafter reads, by split and prompt position (what fc_norm normalises).

    Per split (its first 16 prompts): mean over positions of each aux layer's RMS, and of `final`
    (lm_head's input), for positions below the drafter's training length (the demo's
    data.max_len) and at or beyond it.
    """
    import torch
    from transformers import AutoTokenizer

    from eagle31.config import DrafterConfig
    from eagle31.eval.acceptance import load_prompts
    from eagle31.target import TargetFeatures, load_target, load_target_config

    aux_ids = DrafterConfig.from_target_config(load_target_config(target)).aux_layer_ids
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = load_target(target, torch.device("cpu"), dtype=torch.float32)
    torch.set_num_threads(cfg.threads)
    out = {"aux_layer_ids": list(aux_ids), "trained_len": trained_len, "splits": {}}
    names = [f"aux layer {i}" for i in aux_ids] + ["final"]
    with TargetFeatures(model, aux_ids) as features:
        for split in cfg.splits_list:
            sums = {name: {"below": [0.0, 0], "beyond": [0.0, 0]} for name in names}
            for prompt in load_prompts(corpus / f"{split}.jsonl", tokenizer, 16):
                aux, final = features.capture(torch.tensor([prompt]))  # [1, T, n*Ht], [1, T, Ht]
                chunks = list(aux[0].chunk(len(aux_ids), dim=-1)) + [final[0]]
                for name, h in zip(names, chunks):
                    rms = h.pow(2).mean(-1).sqrt()  # [T]
                    for part, values in (("below", rms[:trained_len]), ("beyond", rms[trained_len:])):
                        sums[name][part][0] += values.sum().item()
                        sums[name][part][1] += values.numel()
            out["splits"][split] = {
                n: {p: (t / c if c else None) for p, (t, c) in parts.items()} for n, parts in sums.items()
            }
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _by(summary: dict, ttt: int, k: int, split: str, variant: str) -> dict:
    return next(
        a
        for a in summary["acceptance"]
        if (a["ttt_length"], a["k"], a["split"], a["variant"]) == (ttt, k, split, variant)
    )


def _tau_cell(row: dict) -> str:
    return f"{row['tau_mean']:.3f} ({', '.join(f'{x:.3f}' for x in row['tau'])})"


def format_results(summary: dict) -> str:
    """Markdown: training metrics, tau per split and k, acceptance rate per draft position."""
    cfg = CompareConfig(**summary["settings"])
    seeds = ", ".join(f"s{s}" for s in cfg.seeds_list)
    out = [f"Training (held-out split of the prepared data, teacher-forced; {cfg.max_steps} steps):", ""]
    out += ["| variant | ttt_length | seed | tau_sim | eval loss | train s |", "|---|---|---|---|---|---|"]
    for t in summary["training"]:
        out.append(
            f"| {NAMES[t['variant']]} | {t['ttt_length']} | {t['seed']} | {t['tau_sim']:.3f} | {t['eval_loss']:.4f} | "
            f"{t['train_time_s']:.0f} |"
        )
    out += ["", f"Acceptance length tau, greedy speculative decoding (mean over seeds; per seed: {seeds}):", ""]
    variants = cfg.variants_list
    delta = "eagle3" in variants and "eagle31" in variants
    header = (
        ["ttt_length", "k", "split", "prompts", "prompt tok"]
        + [f"{NAMES[v]} tau" for v in variants]
        + (["3.1 − 3"] if delta else [])
    )
    out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for ttt in cfg.ttt_lengths_list:
        for k in cfg.ks_list:
            for split in cfg.splits_list:
                rows = {v: _by(summary, ttt, k, split, v) for v in variants}
                first = rows[variants[0]]
                cells = [str(ttt), str(k), split, str(first["prompts"]), f"{first['mean_prompt_tokens']:.0f}"]
                cells += [_tau_cell(rows[v]) for v in variants]
                if delta:
                    cells.append(f"{rows['eagle31']['tau_mean'] - rows['eagle3']['tau_mean']:+.3f}")
                out.append("| " + " | ".join(cells) + " |")
    positions = max(cfg.ks_list)
    out += ["", "Acceptance rate per draft position (vLLM's, unconditional; mean over seeds):", ""]
    out += ["| ttt_length | k | split | variant | " + " | ".join(f"acc@{i + 1}" for i in range(positions)) + " |"]
    out += ["|" + "---|" * (4 + positions)]
    for ttt in cfg.ttt_lengths_list:
        for k in cfg.ks_list:
            for split in cfg.splits_list:
                for v in cfg.variants_list:
                    rates = _by(summary, ttt, k, split, v)["acceptance_rate_mean"]
                    cells = [f"{r:.3f}" for r in rates] + [""] * (positions - len(rates))
                    out.append(f"| {ttt} | {k} | {split} | {NAMES[v]} | " + " | ".join(cells) + " |")
    if "feature_scale" in summary:
        out += ["", format_feature_scale(summary["feature_scale"])]
    return "\n".join(out)


def format_feature_scale(scale: dict) -> str:
    n = scale["trained_len"]
    names = list(next(iter(scale["splits"].values())))
    lines = [
        "RMS of the target features per prompt position (first 16 prompts of each split), "
        f"at positions below {n} (the training length) / from {n} on:",
        "",
    ]
    lines += ["| split | " + " | ".join(names) + " |", "|" + "---|" * (1 + len(names))]
    for split, values in scale["splits"].items():
        cells = [
            " / ".join("–" if values[m][p] is None else f"{values[m][p]:.2f}" for p in ("below", "beyond"))
            for m in names
        ]
        lines.append(f"| {split} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(summary: dict, path: Path) -> None:
    """Top: tau against k per split. Bottom: acceptance rate per position at the largest k. Bars: seed range."""
    from matplotlib.figure import Figure

    cfg = CompareConfig(**summary["settings"])
    splits, ks, ttts = cfg.splits_list, cfg.ks_list, cfg.ttt_lengths_list
    fig = Figure(figsize=(4.2 * len(splits), 7.2), layout="constrained")
    axes = fig.subplots(2, len(splits), sharey="row", squeeze=False)
    styles = ["-", "--", ":", "-."]
    for col, split in enumerate(splits):
        top, bottom = axes[0][col], axes[1][col]
        for v in cfg.variants_list:
            for i, ttt in enumerate(ttts):
                rows = [_by(summary, ttt, k, split, v) for k in ks]
                mean = [r["tau_mean"] for r in rows]
                low = [m - min(r["tau"]) for m, r in zip(mean, rows)]
                high = [max(r["tau"]) - m for m, r in zip(mean, rows)]
                label = f"{NAMES[v]}, ttt {ttt}"
                top.errorbar(
                    ks, mean, yerr=[low, high], color=COLORS[v], ls=styles[i % 4], marker="o", capsize=3, label=label
                )
                rates = _by(summary, ttt, max(ks), split, v)["acceptance_rate_mean"]
                bottom.plot(range(1, len(rates) + 1), rates, color=COLORS[v], ls=styles[i % 4], marker="o", label=label)
        top.set_title(f"{split} ({rows[0]['mean_prompt_tokens']:.0f} prompt tokens)")
        top.set_xlabel("k (draft tokens per round)")
        top.set_xticks(ks)
        bottom.set_xlabel(f"draft position (k = {max(ks)})")
        bottom.set_xticks(range(1, max(ks) + 1))
        bottom.set_ylim(-0.02, 1.02)
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acceptance length tau")
    axes[1][0].set_ylabel("acceptance rate")
    axes[0][0].legend(fontsize="small")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


# ---------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    return study_main(argv, __doc__, CompareConfig, SMOKE, "experiments.eagle3_vs_eagle31.demo", compare)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
