"""EAGLE 3 and EAGLE 3.1, full attention or a sliding window: who holds its acceptance past its training length.

    python -m experiments.long_context windows=none,128 seeds=0,1 out=experiments/long_context/results/demo \\
        runs=runs/long_context -- recipe=demo
    python -m experiments.long_context --smoke ...     # 2 steps, one seed (also SMOKE=1)

One composed recipe for every run (`experiments.harness.comparison_recipe`: the prepared data and shard
store under `runs`, the packed batches in the same order, steps, optimizer and seeds); the runs differ
in the EAGLE 3.1 switches (`eagle3` turns `drafter.fc_norm` and `drafter.norm_output` off) and in
`drafter.sliding_window` (`none`: full attention). Every drafter is measured by one `eagle31.eval.acceptance`
run on every `eval.data` split (greedy chains of k, verified from the target's one decoding of each
prompt). On the demo target the splits are in distribution (`heldout`), an unseen system prompt
(`other_system`) and prompts about 3x the training length (`long_prompt`, ~1,145 tokens after training at
`data.max_len` = 384).

Per split and setting (variant x window): tau per seed and their mean; its ratio to the same setting's tau
on the first split (in distribution; the issue's goal is >= 0.9 on the long probe with a window); and EAGLE
3.1 against EAGLE 3 under the same window, `higher` / `lower` when every seed of 3.1 is above (below) every
seed of 3 (`experiments.harness.separation`). Trained runs are reused and a killed one continues
(`resume=auto`); drafters already measured under `out` are kept (same weights, or a run no longer here).
Writes under `out`: `commands.sh`, `acceptance/`, `summary.json` and `results.md`.

Long training data: `train_turns=N` (N > 1) is the recipe override `data.merge_turns=N`: the recipe's
conversations merged, in their order, into multi-turn samples of 1 to N of them (`eagle31.data.merge_turns`),
so the drafters see long histories of earlier turns, as the long probe has; with `-- data.max_len=<4x>` they
train at 4x the length on the same tokens (`-- recipe=demo_long` is both).

Keys: out, runs, variants (eagle3, eagle31), windows (`none` or positions, comma list), seeds, max_steps,
k, max_prompts (per split), max_new_tokens, threads, measure, train_turns.
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from experiments.harness import (
    StudyConfig,
    acceptance_splits_of,
    comparison_recipe,
    format_training,
    log_command,
    measure_drafters,
    report_body,
    separation,
    shared_settings,
    study_main,
    tau_over_seeds,
    train_missing,
    training_reports,
    write_summary,
)

# the EAGLE 3.1 switches, as recipe overrides (EAGLE 3 is EAGLE 3.1 with both off)
VARIANTS = {"eagle3": ["drafter.fc_norm=false", "drafter.norm_output=false"], "eagle31": []}
NAMES = {"eagle3": "EAGLE 3", "eagle31": "EAGLE 3.1"}
SMOKE = dict(seeds="0", windows="none,4", max_steps=2, k=2, max_prompts=2, max_new_tokens=8)
HOLDS = 0.9  # the goal: tau on the long probe >= 90% of tau in distribution


@dataclass
class LongContextConfig(StudyConfig):
    out: str = "experiments/long_context/results/demo"
    runs: str = "runs/long_context"
    variants: str = "eagle3,eagle31"
    windows: str = "none,128"  # drafter.sliding_window of each attention setting; none: full attention
    max_prompts: int = 32
    train_turns: int = 1  # > 1: data.merge_turns (long multi-turn training samples)

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.variant_list, self.window_list  # raise on bad lists
        if self.train_turns < 1:
            raise ConfigError(f"train_turns must be a positive integer, got {self.train_turns}")

    @property
    def variant_list(self) -> list[str]:
        variants = [v.strip() for v in self.variants.split(",") if v.strip()]
        if not variants or any(v not in VARIANTS for v in variants) or len(set(variants)) != len(variants):
            raise ConfigError(f"variants must list distinct ones of {', '.join(VARIANTS)}, got {self.variants!r}")
        return variants

    @property
    def window_list(self) -> list[int | None]:
        windows = []
        for w in (x.strip() for x in self.windows.split(",") if x.strip()):
            if w == "none":
                windows.append(None)
            elif w.isdigit() and int(w) > 0:
                windows.append(int(w))
            else:
                raise ConfigError(f"windows must list `none` or positive position counts, got {self.windows!r}")
        if not windows or len(set(windows)) != len(windows):
            raise ConfigError(f"windows must list distinct settings, got {self.windows!r}")
        return windows


def window_name(window: int | None) -> str:
    return "full" if window is None else f"w{window}"


def run_name(variant: str, window: int | None, seed: int) -> str:
    return f"{variant}-{window_name(window)}-s{seed}"


def run_dirs(cfg: LongContextConfig) -> dict[str, Path]:
    """Every run of the study: its name -> its directory under `runs`."""
    names = [run_name(v, w, s) for v in cfg.variant_list for w in cfg.window_list for s in cfg.seed_list]
    return {name: Path(cfg.runs) / name for name in names}


def summarize(cfg: LongContextConfig, acceptance: dict, recipe) -> dict:
    splits = acceptance_splits_of(acceptance)
    settings = [(v, w) for v in cfg.variant_list for w in cfg.window_list]
    taus = {
        (split, v, w): tau_over_seeds(acceptance, split, [run_name(v, w, s) for s in cfg.seed_list])
        for split in splits
        for v, w in settings
    }
    rows = []
    for split in splits:
        for v, w in settings:
            row = {"split": split, "variant": v, "window": w, **taus[(split, v, w)]}
            row["of_first_split"] = row["mean"] / taus[(splits[0], v, w)]["mean"]
            if v == "eagle31" and "eagle3" in cfg.variant_list:
                row["vs_eagle3"] = row["mean"] - taus[(split, "eagle3", w)]["mean"]
                row["separation"] = separation(row, taus[(split, "eagle3", w)])
            rows.append(row)
    shared = shared_settings(recipe)
    for key in ("fc_norm", "norm_output", "sliding_window"):  # the keys that differ are per run
        shared["drafter"].pop(key, None)
    return {
        "date": datetime.date.today().isoformat(),
        "settings": {**asdict(cfg), "recipe": shared},
        "first_split": splits[0],
        "acceptance": rows,
        "training": training_reports(run_dirs(cfg), Path(cfg.out)),
    }


def format_results(summary: dict) -> str:
    cfg, first = summary["settings"], summary["first_split"]
    train, data = cfg["recipe"]["train"], cfg["recipe"]["data"]
    seeds = ", ".join(f"s{s}" for s in cfg["seeds"].split(","))
    lines = [
        f"EAGLE 3 and EAGLE 3.1, full attention and sliding windows, recipe {cfg['recipe']['recipe']}: "
        f"{train['max_steps']} steps, TTT {train['ttt_length']}, trained at data.max_len = {data['max_len']}.",
        "",
        f"Acceptance length tau, greedy chains of k = {cfg['k']}, {cfg['max_prompts']} prompts per split (mean over "
        f"seeds; per seed: {seeds}); `/ {first}`: the setting's tau over its tau on {first} (goal >= {HOLDS} with a "
        "window); `3.1 - 3`: under the same window, `higher` / `lower` when every seed of 3.1 is above / below every "
        "seed of 3:",
        "",
        f"| split | variant | window | tau | / {first} | 3.1 - 3 |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary["acceptance"]:
        versus = "–"
        if "vs_eagle3" in r:
            versus = f"{r['vs_eagle3']:+.3f}" + (f" ({r['separation']})" if r["separation"] else " (within the spread)")
        cells = [
            r["split"],
            NAMES[r["variant"]],
            "full" if r["window"] is None else str(r["window"]),
            f"{r['mean']:.3f} ({', '.join(f'{t:.3f}' for t in r['tau'])})",
            f"{r['of_first_split']:.3f}",
            versus,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + format_training(summary["training"]))


def long_context(cfg: LongContextConfig, overrides: list[str], command: str) -> dict | None:
    """Train what is missing, then measure and summarise (None with measure=false)."""
    import torch

    torch.set_num_threads(cfg.threads)
    out, runs = Path(cfg.out), Path(cfg.runs)
    if cfg.train_turns > 1:  # long multi-turn training samples (eagle31.data.merge_turns)
        overrides = [*overrides, f"data.merge_turns={cfg.train_turns}"]
    recipes = {}
    for v in cfg.variant_list:
        for w in cfg.window_list:
            window = [f"drafter.sliding_window={'null' if w is None else w}"]
            for s in cfg.seed_list:  # composed (and so checked) before anything runs
                recipes[run_name(v, w, s)] = comparison_recipe(
                    runs, runs / run_name(v, w, s), s, cfg.max_steps, [*overrides, *VARIANTS[v], *window]
                )
    recipe = next(iter(recipes.values()))
    if not recipe.eval.data:
        raise ConfigError("eval.data names no prompt file: nothing to measure the drafters on")
    out.mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    train_missing(recipes, runs, out)
    if not cfg.measure:
        return None
    drafters = {name: run / "drafter" for name, run in run_dirs(cfg).items()}
    acceptance = measure_drafters(
        drafters, recipe, k=cfg.k, max_new_tokens=cfg.max_new_tokens, max_prompts=cfg.max_prompts, out=out
    )
    summary = summarize(cfg, acceptance, recipe)
    return write_summary(out, summary, format_results(summary))


def main(argv: list[str]) -> int:
    def trained(cfg: LongContextConfig) -> str:
        return (
            f"trained variants {cfg.variants}, windows {cfg.windows}, seeds {cfg.seeds} under {cfg.runs}; "
            "measure=true measures them"
        )

    return study_main(
        argv,
        __doc__,
        LongContextConfig,
        SMOKE,
        "experiments.long_context",
        report_body(long_context, format_results, trained),
    )
