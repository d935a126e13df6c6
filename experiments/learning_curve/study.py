"""tau against training tokens for EAGLE 3 and EAGLE 3.1: one drafter per (variant, budget), MT-Bench replay.

    python -m experiments.learning_curve budgets=75,150,300,1000 out=experiments/learning_curve/results/smollm2 \\
        runs=runs/smollm2/curve -- recipe=smollm2_135m regenerate.output_dir=runs/smollm2/regenerated \\
        "data.source=[runs/smollm2/regenerated/conversations]" data.prepared_dir=runs/smollm2/data \\
        features.store_dir=runs/smollm2/features        # after `--`: recipe overrides, every point
    python -m experiments.learning_curve --smoke ...      # one tiny budget end to end (also SMOKE=1)

Every point is its own training with `train/main.py`'s pipeline (`eagle31.pipeline.run`):
`train.max_steps` = the budget, the recipe's warm-up + cosine schedule over it, the same
prepared data and feature store (pass the chain's `data.prepared_dir` and `features.store_dir`
to reuse what `scripts/smollm2_chain.sh` made), the same seed; `eagle3` turns both EAGLE 3.1
switches off. A budget past one epoch reads the data several times: `epochs` in the results
says how many (tokens seen / training tokens).

Then MT-Bench (`eagle31.eval.mtbench.run_mt_bench`: the target decodes each turn once, every drafter
is replayed on it) measures, in one run, every trained point that has no result yet, in chains
of `ks` and the EAGLE-2 tree. Resumable: a point whose training finished (`report.json`) is not
trained again, a killed one continues from its checkpoint (`resume=auto`), and a measured one
(`<out>/points/<point>.json`) is not measured again; so `budgets=` can grow between calls.
Writes under `out`: `points/`, `curve.json`, `curve.md` (tau per mode against tokens seen) and
`curve.png`, `commands.sh` (what ran).

Keys: out, runs, budgets (train.max_steps per point), variants (eagle3, eagle31), seed, ks,
tree_top_k / tree_depth / tree_total_tokens (0: no tree), max_per_category, max_new_tokens, threads.
"""

from __future__ import annotations

import datetime
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from eagle31.io import atomic_path, atomic_write_json, atomic_write_text
from experiments.harness import ROOT, log_command, study_main, trained_before

# the two drafters compared, as recipe overrides (as scripts/smollm2_chain.sh names them)
VARIANTS = {"eagle3": ["drafter.fc_norm=false", "drafter.norm_output=false"], "eagle31": []}
SMOKE = dict(budgets="2", ks="2", tree_top_k=2, tree_depth=2, tree_total_tokens=3, max_per_category=1, max_new_tokens=8)


@dataclass
class CurveConfig:
    out: str = "experiments/learning_curve/results/smollm2"
    runs: str = "runs/learning_curve"
    budgets: str = "75,150,300,1000"  # on SmolLM2 a step is ~3.7 s of one core: 1000 steps ~an hour
    variants: str = "eagle3,eagle31"
    seed: int = 0
    ks: str = "5"
    tree_top_k: int = 8
    tree_depth: int = 5
    tree_total_tokens: int = 32
    questions: str = "mtbench:"
    max_per_category: int = 2
    max_new_tokens: int = 128
    threads: int = 2

    def __post_init__(self) -> None:
        _ = self.budget_list, self.variant_list  # raise on bad lists
        for name in ("max_per_category", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")

    @property
    def budget_list(self) -> list[int]:
        try:
            budgets = sorted({int(b) for b in self.budgets.split(",") if b.strip()})
        except ValueError:
            raise ConfigError(f"budgets must be a comma-separated list of step counts, got {self.budgets!r}") from None
        if not budgets or budgets[0] < 1:
            raise ConfigError(f"budgets must name positive step counts, got {self.budgets!r}")
        return budgets

    @property
    def variant_list(self) -> list[str]:
        variants = [v.strip() for v in self.variants.split(",") if v.strip()]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or not variants:
            raise ConfigError(f"variants: {', '.join(unknown) or 'none given'}; known: {', '.join(VARIANTS)}")
        return variants

    @property
    def tree(self) -> dict:
        return (
            dict(tree_top_k=self.tree_top_k, tree_depth=self.tree_depth, tree_total_tokens=self.tree_total_tokens)
            if self.tree_top_k
            else {}
        )


def point_name(cfg: CurveConfig, variant: str, steps: int) -> str:
    return f"{variant}-s{cfg.seed}-steps{steps}"


def point_recipe(cfg: CurveConfig, overrides: list[str], variant: str, steps: int):
    from eagle31.recipe import load_recipe

    fixed = [
        f"output_dir={Path(cfg.runs) / point_name(cfg, variant, steps)}",
        f"seed={cfg.seed}",
        f"train.max_steps={steps}",
        "resume=auto",  # a killed training continues from its last checkpoint
        "export.formats=[]",  # MT-Bench reads the run's drafter/
        "logging.wandb.mode=disabled",
        "logging.progress=false",
        *VARIANTS[variant],
    ]
    return load_recipe(ROOT / "recipes", [*overrides, *fixed])


def measure(cfg: CurveConfig, recipe, names: list[str]) -> dict:
    """One MT-Bench run over the drafters of `names` (the target decodes each turn once)."""
    from eagle31.data.prepare import template_kwargs
    from eagle31.eval.mtbench import MTBenchConfig, run_mt_bench
    from eagle31.targets import resolve_target_path

    config = MTBenchConfig(
        drafter=",".join(f"{n}={Path(cfg.runs) / n / 'drafter'}" for n in names),
        target=str(resolve_target_path(recipe.target)),
        questions=cfg.questions,
        ks=cfg.ks,
        max_new_tokens=cfg.max_new_tokens,
        max_per_category=cfg.max_per_category,
        chat_template_kwargs=json.dumps(template_kwargs(recipe.data)),
        device="cpu",
        **cfg.tree,
    )
    return run_mt_bench(config, log=lambda line: print(line, file=sys.stderr))


def point_result(report: dict, name: str, training: dict, train_tokens: int) -> dict:
    """One point: its training figures and tau per mode over all MT-Bench questions."""
    settings = {k: v for k, v in report["settings"].items() if k != "drafters"}
    taus = {r["mode"]: r["tau"] for r in report["results"] if r["drafter"] == name and r["split"] == "all"}
    return {
        "point": name,
        "steps": training["steps"],
        "tokens_seen": training["tokens_seen"],
        "epochs": training["tokens_seen"] / train_tokens,
        "train_time_s": training.get("train_time_s"),
        "tau_sim": training.get("tau_sim"),
        "tau": taus,
        "results": [r for r in report["results"] if r["drafter"] == name],
        "mt_bench": settings,
    }


def format_curve(curve: dict) -> str:
    modes = list(dict.fromkeys(m for p in curve["points"] for m in p["tau"]))
    lines = [
        f"MT-Bench tau against training tokens, recipe {curve['recipe']}, seed {curve['seed']} "
        f"(each point its own training; {curve['train_tokens']} training tokens per epoch)",
        "",
        "| variant | steps | tokens seen | epochs | train s | " + " | ".join(modes) + " |",
        "|" + "---|" * (5 + len(modes)),
    ]
    for p in curve["points"]:
        cells = [
            p["variant"],
            str(p["steps"]),
            str(p["tokens_seen"]),
            f"{p['epochs']:.2f}",
            f"{p['train_time_s'] or 0:.0f}",
        ]
        lines.append("| " + " | ".join(cells + [f"{p['tau'][m]:.3f}" if m in p["tau"] else "–" for m in modes]) + " |")
    return "\n".join(lines)


def plot_curve(curve: dict, path: Path) -> None:
    """tau per mode (a panel each) against tokens seen, a line per variant."""
    from matplotlib.figure import Figure  # the object API: no pyplot, no global state

    modes = list(dict.fromkeys(m for p in curve["points"] for m in p["tau"]))
    fig = Figure(figsize=(4.6 * max(len(modes), 1), 3.8), layout="constrained")
    axes = fig.subplots(1, max(len(modes), 1), squeeze=False)[0]
    for ax, mode in zip(axes, modes):
        for variant in dict.fromkeys(p["variant"] for p in curve["points"]):
            points = [p for p in curve["points"] if p["variant"] == variant and mode in p["tau"]]
            ax.plot([p["tokens_seen"] for p in points], [p["tau"][mode] for p in points], marker="o", label=variant)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens seen")
        ax.set_ylabel("MT-Bench tau")
        ax.set_title(mode)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)


def learning_curve(cfg: CurveConfig, overrides: list[str], command: str) -> dict:
    import torch

    from eagle31.pipeline import run

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    (out / "points").mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    points = [(v, s) for v in cfg.variant_list for s in cfg.budget_list]
    recipes = {p: point_recipe(cfg, overrides, *p) for p in points}  # every override checked before training
    for variant, steps in points:
        name = point_name(cfg, variant, steps)
        if trained_before(Path(cfg.runs) / name, set()):
            print(f"skip (trained): {name}", file=sys.stderr)
            continue
        print(f"train: {name}", file=sys.stderr)
        run(recipes[(variant, steps)])
    recipe = recipes[points[0]]
    prepared = json.loads((Path(recipe.data.prepared_dir) / "report.json").read_text())
    train_tokens = prepared["tokens"]["train"]
    todo = [point_name(cfg, *p) for p in points if not (out / "points" / f"{point_name(cfg, *p)}.json").is_file()]
    if todo:
        report = measure(cfg, recipe, todo)
        for name in todo:
            training = json.loads((Path(cfg.runs) / name / "report.json").read_text())
            atomic_write_json(out / "points" / f"{name}.json", point_result(report, name, training, train_tokens))
    curve = {
        "date": datetime.date.today().isoformat(),
        "recipe": recipe.name,
        "seed": cfg.seed,
        "train_tokens": train_tokens,
        "settings": asdict(cfg),
        "points": [],
    }
    for variant, steps in points:
        point = json.loads((out / "points" / f"{point_name(cfg, variant, steps)}.json").read_text())
        curve["points"].append(
            {"variant": variant, **{k: v for k, v in point.items() if k not in ("results", "mt_bench")}}
        )
    atomic_write_json(out / "curve.json", curve)
    atomic_write_text(out / "curve.md", format_curve(curve) + "\n")
    plot_curve(curve, out / "curve.png")
    return curve


def main(argv: list[str]) -> int:
    def body(cfg: CurveConfig, overrides: list[str], command: str) -> None:
        curve = learning_curve(cfg, overrides, command)
        print(format_curve(curve))
        print(f"\nwrote {Path(cfg.out) / 'curve.json'}, {Path(cfg.out) / 'curve.md'}, {Path(cfg.out) / 'curve.png'}")

    return study_main(argv, __doc__, CurveConfig, SMOKE, "experiments.learning_curve", body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
