"""Each `train.loss` on equal work: eagle31 drafters that differ only in their loss, measured together.

    python -m experiments.loss_comparison losses=kl,tv,lk_alpha,lk_hybrid,ce seeds=0,1 runs=runs/smollm2 \\
        out=experiments/loss_comparison/results/smollm2 -- recipe=smollm2_135m ... "eval.data=[...]"
    python -m experiments.loss_comparison --smoke ...     # 2 steps, one seed (also SMOKE=1)

The side-by-side's setting (`experiments.side_by_side.study`): one composed recipe for every run (the
prepared data and shard store under `runs`, the draft vocabulary, the packed batches in the same
order, steps, optimizer, schedule and seeds), `train.loss` the only key that differs, and every
drafter measured by one `eagle31.eval.acceptance` run on every `eval.data` split (greedy chains of k).
The first loss listed is the baseline; its runs are named as the side-by-side's eagle31 runs
(`eagle31-s<seed>`), so with the same `runs` the default loss (kl) is trained once for both, and
the others are `eagle31-<loss>-s<seed>`. Trained runs are reused and a killed one continues
(`resume=auto`); `measure=false` trains only, so that several processes can share the trainings.
Drafters already measured under `out` are kept as the side-by-side keeps them (same weights, or a
run no longer here), so a later session adds losses or seeds to the comparison without retraining.

Per split: tau of each loss per seed and their mean, the ratio to the baseline's mean, and
whether the loss is outside the baseline's seed spread (`higher`: its every seed above the
baseline's every seed; `lower`: the reverse) — the bar for making a loss the default. Writes
under `out`: `commands.sh`, `acceptance/`, `summary.json` and `results.md`.

Keys: out, runs, losses (train.loss values, the baseline first), seeds, max_steps, k,
max_prompts (per split), max_new_tokens, threads, measure.
"""

from __future__ import annotations

import datetime
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from eagle31.loss import DraftLoss
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

SMOKE = dict(seeds="0", max_steps=2, k=2, max_prompts=2, max_new_tokens=8)


@dataclass
class LossComparisonConfig(StudyConfig):
    out: str = "experiments/loss_comparison/results/demo"
    runs: str = "runs/side_by_side"
    losses: str = "kl,tv,lk_alpha,lk_hybrid,ce"

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.loss_list  # raise on a bad list

    @property
    def loss_list(self) -> list[str]:
        losses = [x.strip() for x in self.losses.split(",") if x.strip()]
        unknown = [x for x in losses if x not in DraftLoss.__members__]
        if unknown or len(losses) < 2 or len(set(losses)) != len(losses):
            raise ConfigError(
                f"losses must be two or more distinct train.loss values ({', '.join(DraftLoss.__members__)}), "
                f"got {self.losses!r}"
            )
        return losses


def run_name(cfg: LossComparisonConfig, loss: str, seed: int) -> str:
    """The baseline's runs are the side-by-side's eagle31 runs."""
    return f"eagle31-s{seed}" if loss == cfg.loss_list[0] else f"eagle31-{loss}-s{seed}"


def run_dirs(cfg: LossComparisonConfig) -> dict[str, Path]:
    """Every run of the comparison: its name -> its directory under `runs`."""
    return {
        run_name(cfg, loss, s): Path(cfg.runs) / run_name(cfg, loss, s) for loss in cfg.loss_list for s in cfg.seed_list
    }


def summarize(cfg: LossComparisonConfig, acceptance: dict, recipe) -> dict:
    losses, baseline = cfg.loss_list, cfg.loss_list[0]
    rows = []
    for split in acceptance_splits_of(acceptance):
        taus = {
            loss: tau_over_seeds(acceptance, split, [run_name(cfg, loss, s) for s in cfg.seed_list]) for loss in losses
        }
        for loss, row in taus.items():
            row["ratio"] = row["mean"] / taus[baseline]["mean"]
            row["separation"] = None if loss == baseline else separation(row, taus[baseline])
        rows.append({"split": split, "losses": taus})
    shared = shared_settings(recipe)
    del shared["train"]["loss"]  # the one key that differs
    return {
        "date": datetime.date.today().isoformat(),
        "settings": {**asdict(cfg), "recipe": shared},
        "acceptance": rows,
        "training": training_reports(run_dirs(cfg), Path(cfg.out)),
    }


def format_results(summary: dict) -> str:
    cfg = summary["settings"]
    train = cfg["recipe"]["train"]
    losses = cfg["losses"].split(",")
    seeds = ", ".join(f"s{s}" for s in cfg["seeds"].split(","))
    lines = [
        f"eagle31 drafters by train.loss, recipe {cfg['recipe']['recipe']}, {train['max_steps']} steps, "
        f"TTT {train['ttt_length']}, lr {train['lr']}, lk_eta {train['lk_eta']}; baseline {losses[0]}.",
        "",
        f"Acceptance length tau, greedy chains of k = {cfg['k']}, {cfg['max_prompts']} prompts per split "
        f"(mean over seeds; per seed: {seeds}); outside the spread: every seed above (higher) or below (lower) "
        f"every seed of {losses[0]}:",
        "",
        f"| split | loss | tau | / {losses[0]} | outside the spread |",
        "|---|---|---|---|---|",
    ]
    for row in summary["acceptance"]:
        for loss in losses:
            r = row["losses"][loss]
            cells = [
                row["split"],
                loss,
                f"{r['mean']:.3f} ({', '.join(f'{t:.3f}' for t in r['tau'])})",
                f"{r['ratio']:.3f}",
                "–" if loss == losses[0] else (r["separation"] or "no"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + format_training(summary["training"]))


def loss_comparison(cfg: LossComparisonConfig, overrides: list[str], command: str) -> dict | None:
    """Train what is missing, then measure and summarise (None with measure=false)."""
    import torch

    torch.set_num_threads(cfg.threads)
    out, runs = Path(cfg.out), Path(cfg.runs)
    recipes = {
        (loss, s): comparison_recipe(
            runs, runs / run_name(cfg, loss, s), s, cfg.max_steps, [*overrides, f"train.loss={loss}"]
        )
        for loss in cfg.loss_list
        for s in cfg.seed_list
    }  # composed (and so checked) before anything runs
    recipe = recipes[(cfg.loss_list[0], cfg.seed_list[0])]
    if not recipe.eval.data:
        raise ConfigError("eval.data names no prompt file: nothing to measure the drafters on")
    out.mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    losses = {run_name(cfg, loss, seed): loss for loss, seed in recipes}
    train_missing(
        {run_name(cfg, *key): r for key, r in recipes.items()}, runs, out, lambda name: f" (train.loss={losses[name]})"
    )
    if not cfg.measure:
        return None
    drafters = {name: run / "drafter" for name, run in run_dirs(cfg).items()}
    acceptance = measure_drafters(
        drafters, recipe, k=cfg.k, max_new_tokens=cfg.max_new_tokens, max_prompts=cfg.max_prompts, out=out
    )
    summary = summarize(cfg, acceptance, recipe)
    return write_summary(out, summary, format_results(summary))


def main(argv: list[str]) -> int:
    def trained(cfg: LossComparisonConfig) -> str:
        return f"trained losses {cfg.losses}, seeds {cfg.seeds} under {cfg.runs}; measure=true measures them"

    return study_main(
        argv,
        __doc__,
        LossComparisonConfig,
        SMOKE,
        "experiments.loss_comparison",
        report_body(loss_comparison, format_results, trained),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
