"""What every study shares: its recipe of equal work, training, measuring with resume, and its command line.

A study (`experiments/<name>/`) trains eagle31 drafters (and peers') that differ only in what it
compares, measures them together by one `eagle31.eval.acceptance` run, and summarises. The pieces:

    StudyConfig         the keys every measured study shares (its config's base)
    comparison_recipe   a run of a comparison: the user's overrides, then the keys every run shares
    trained_before      a run that needs no training (its report is there, or an earlier summary has it)
    measure_drafters    one acceptance run over labelled drafters; earlier measurements kept (same
                        settings, and the same weights by sha256 or a run no longer here)
    training_reports    what each run's report.json says of its training (or the earlier summary)
    study_main          the command line of a study: key=value, then `--` and recipe overrides
    separation          whether one setting's seeds all lie above (or below) another's
    train_missing       train the runs whose training is not done yet
    write_summary       summary.json and results.md of a study
    report_body         a study's `study_main` body: run it, print its results and what it wrote
"""

from __future__ import annotations

import datetime
import hashlib
import json
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from eagle31.io import atomic_write_json, atomic_write_text
from eagle31.targets.cache import cache_dir, portable_path
from eagle31_cli import parse_keys_then_overrides, run_cli, wants_help

ROOT = Path(__file__).resolve().parents[1]


def parse_seeds(text: str) -> list[int]:
    """`seeds=` "0,1" -> [0, 1]."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"seeds must be a comma-separated list of integers, got {text!r}") from None
    if not seeds:
        raise ConfigError("seeds= names no seed")
    return seeds


@dataclass
class StudyConfig:
    """The keys of a study that trains drafters and measures them together (`measure_drafters`)."""

    out: str = ""  # where its results go
    runs: str = ""  # its training run directories
    seeds: str = "0,1"
    max_steps: int | None = None  # None: the recipe's train.max_steps
    k: int = 3  # draft tokens per round
    max_prompts: int = 16  # per split
    max_new_tokens: int = 48
    threads: int = 1
    measure: bool = True  # false: train only

    def __post_init__(self) -> None:
        _ = self.seed_list  # raise on a bad list
        for name in ("k", "max_prompts", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be a positive integer, got {self.max_steps}")

    @property
    def seed_list(self) -> list[int]:
        return parse_seeds(self.seeds)


def log_command(out: Path, command: str) -> None:
    """Append what ran to out/commands.sh, dated, without this machine's cache path."""
    with open(out / "commands.sh", "a", encoding="utf-8") as f:
        f.write(f"# {datetime.datetime.now().isoformat(timespec='seconds')}, from the repository root\n")
        f.write(command.replace(str(cache_dir()), "$EAGLE31_CACHE") + "\n")


def comparison_recipe(
    runs: Path, output_dir: Path, seed: int, max_steps: int | None, overrides: list[str], device: str = "cpu"
):
    """A run of a comparison on equal work: `overrides`, then the keys every run of it shares (one prepared
    data and shard store under `runs`, packed batches, one per step, the device) and its own output_dir and seed."""
    from eagle31.recipe import load_recipe

    fixed = [
        f"output_dir={output_dir}",
        f"seed={seed}",
        "resume=auto",  # a killed training continues from its last checkpoint (a finished one is skipped)
        f"data.prepared_dir={runs}/data",  # prepared once: one tokenisation, one draft vocabulary
        "features.mode=store",
        f"features.store_dir={runs}/features",  # captured once: the same features on both sides
        "features.batching=pack",  # speculators trains on packed rows; SpecForge gets their documents
        "train.grad_accum=1",  # one batch per optimizer step on both sides
        f"train.device={device}",
        "eval.enabled=false",  # the acceptance of both is measured together, below
        "export.formats=[]",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
    ]
    if max_steps is not None:
        fixed.append(f"train.max_steps={max_steps}")
    return load_recipe(ROOT / "recipes", [*overrides, *fixed])


def train_eagle31(recipe) -> dict:
    from eagle31.pipeline import run

    return run(recipe)


def measure_drafters(
    drafters: dict[str, Path],
    recipe,
    *,
    k: int,
    max_new_tokens: int,
    max_prompts: int,
    out: Path,
    device: str = "cpu",
    report_folder: str = "acceptance",
) -> dict:
    """One `eagle31.eval.acceptance` run of the labelled drafters with the recipe's target on every `eval.data`
    split (greedy chains of k, verified from the target's one greedy decoding of each prompt); its report
    under out/`report_folder` (a study that measures several times: one folder each).

    What a report already there measured with the same settings is kept, not measured again: a drafter
    whose weights still have the sha256 it recorded, and one whose directory is gone (an earlier session's
    run that this machine no longer holds; listed in the report's `settings.kept`)."""
    from eagle31.data.prepare import template_kwargs
    from eagle31.eval.acceptance import (
        AcceptanceConfig,
        Verification,
        report_settings,
        run_acceptance,
    )
    from eagle31.eval.acceptance_report import write_report
    from eagle31.pipeline import acceptance_splits
    from eagle31.targets import resolve_target_path

    def config_of(labels: list[str]) -> AcceptanceConfig:
        return AcceptanceConfig(
            drafter=",".join(f"{label}={drafters[label]}" for label in labels),
            target=str(resolve_target_path(recipe.target)),
            data=acceptance_splits(recipe),
            chat_template_kwargs=json.dumps(template_kwargs(recipe.data)),
            k=k,
            max_new_tokens=max_new_tokens,
            max_prompts=max_prompts,
            verification=Verification.replay,
            device=device,
        )

    sha256 = {label: drafter_sha256(path) for label, path in drafters.items() if path.is_dir()}
    report_path = out / report_folder / "acceptance.json"
    if not sha256:
        raise ConfigError(
            f"none of the drafters {', '.join(drafters)} is here to measure (what {report_path} holds stands)"
        )
    settings = {
        **report_settings(config_of(list(sha256))),
        "drafters": {label: portable_path(p) for label, p in drafters.items()},
    }
    earlier = json.loads(report_path.read_text()) if report_path.is_file() else None
    kept = kept_measurements(earlier, settings, sha256)
    measured_there = {r["drafter"] for r in earlier["results"]} if earlier else set()
    for label, path in drafters.items():
        if label in kept:
            print(
                f"kept (measured earlier, {'same weights' if label in sha256 else 'its run is not here'}): {label}",
                file=sys.stderr,
            )
        elif label not in sha256:
            why = f"no earlier measurement of it under {report_path}"
            if label in measured_there:  # not kept, so its settings differ
                differ = ", ".join(settings_differ(earlier, settings))
                why = f"its earlier measurement under {report_path} has other {differ}"
            raise ConfigError(f"{path}: no drafter there to measure {label}, and {why}")
    missing = [label for label in drafters if label not in kept]
    measured = run_acceptance(config_of(missing)) if missing else {"results": []}
    rows = {(r["drafter"], r["split"]): r for r in earlier["results"] if r["drafter"] in kept} if kept else {}
    rows.update({(r["drafter"], r["split"]): r for r in measured["results"]})
    report = {
        "settings": {**settings, **kept_settings(earlier, drafters, kept, sha256)},
        "results": [rows[(label, split)] for label in drafters for split in settings["data"]],
    }
    check_one_target_decoding(report, report_path)
    write_report(report, out / report_folder)
    return report


def drafter_sha256(drafter_dir: Path) -> str:
    """One sha256 over a drafter directory's files (their names and contents)."""
    from eagle31.io import sha256_file

    files = sorted(p for p in drafter_dir.rglob("*") if p.is_file())
    listing = "".join(f"{p.relative_to(drafter_dir)}:{sha256_file(p)}\n" for p in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def kept_measurements(earlier: dict | None, settings: dict, sha256: dict[str, str]) -> set[str]:
    """The drafters of an earlier report that need no new measurement: same settings (all but the drafters),
    and the same weights, or weights no longer here to measure."""
    if earlier is None or settings_differ(earlier, settings):
        return set()
    recorded = earlier["settings"].get("drafter_sha256", {})
    measured = {r["drafter"] for r in earlier["results"]}
    return {
        label
        for label in settings["drafters"]
        if label in measured and (label not in sha256 or recorded.get(label) == sha256[label])
    }


def kept_settings(earlier: dict | None, drafters: dict, kept: set[str], sha256: dict[str, str]) -> dict:
    """A joined report's `drafter_sha256` (each drafter's; one no longer here as `earlier` recorded it) and `kept`
    (the drafters measured earlier whose runs are no longer here)."""
    recorded = earlier["settings"].get("drafter_sha256", {}) if earlier else {}
    return {
        "drafter_sha256": {label: sha256.get(label) or recorded.get(label) for label in drafters},
        "kept": sorted(label for label in kept if label not in sha256),
    }


def settings_differ(earlier: dict, settings: dict) -> list[str]:
    """The measurement settings (all but the drafters) in which an earlier report differs from `settings`."""
    ignored = {"drafters", "drafter_sha256", "kept"}
    keys = (set(earlier["settings"]) | set(settings)) - ignored
    return sorted(k for k in keys if earlier["settings"].get(k) != settings.get(k))


def check_one_target_decoding(report: dict, path: Path) -> None:
    """Every drafter of a split was verified against the same decoding of the target (replay: the same
    prompt and generated token counts), which also holds rows kept from an earlier measurement to it."""
    for split in acceptance_splits_of(report):
        counts = {(r["prompt_tokens"], r["generated_tokens"]) for r in report["results"] if r["split"] == split}
        if len(counts) > 1:
            raise ConfigError(
                f"{path}: split {split}: the drafters saw different target decodings (prompt, generated tokens: "
                f"{sorted(counts)}); measure them all again into a new out="
            )


def acceptance_splits_of(acceptance: dict) -> list[str]:
    return list(dict.fromkeys(r["split"] for r in acceptance["results"]))


def tau_over_seeds(acceptance: dict, split: str, labels: list[str]) -> dict:
    """tau of the drafters `labels` (one per seed) on `split`: the list, mean, min and max."""
    taus = [
        next(r["tau"] for r in acceptance["results"] if r["split"] == split and r["drafter"] == label)
        for label in labels
    ]
    return {"tau": taus, "mean": sum(taus) / len(taus), "min": min(taus), "max": max(taus)}


def separation(row: dict, baseline: dict) -> str | None:
    """`higher` / `lower` when every seed of `row` is above (below) every seed of `baseline` (`tau_over_seeds`),
    else None (also with one seed on a side: no spread to be outside of)."""
    if min(len(row["tau"]), len(baseline["tau"])) < 2:  # one seed has no spread
        return None
    if row["min"] > baseline["max"]:
        return "higher"
    if row["max"] < baseline["min"]:
        return "lower"
    return None


def measured_earlier(out: Path, reports: list[str] | None = None) -> set[str]:
    """The runs that the summary under `out` records as trained and every report (paths under `out`; the
    acceptance report when None) as measured."""
    paths = [out / "summary.json", *(out / r for r in reports or ["acceptance/acceptance.json"])]
    if not all(p.is_file() for p in paths):
        return set()
    earlier = set(json.loads(paths[0].read_text())["training"])
    for path in paths[1:]:
        earlier &= {r["drafter"] for r in json.loads(path.read_text())["results"]}
    return earlier


def trained_before(run: Path, earlier: set[str]) -> bool:
    """`run` needs no training: its report.json is there, or it is gone and `earlier` (`measured_earlier`) has it."""
    return (run / "report.json").is_file() or (not run.exists() and run.name in earlier)


def train_missing(
    recipes: dict,
    runs: Path,
    out: Path,
    describe: Callable[[str], str] = lambda name: "",
    trainers: dict[str, Callable] | None = None,
    reports: list[str] | None = None,
) -> None:
    """Train, in order, each named run of `recipes` (its directory `runs / name`) that `trained_before` does not
    skip (`reports`: what `measured_earlier` reads), with its trainer in `trainers` (`train_eagle31` where none is
    named); `describe(name)` is added to its progress line."""
    earlier = measured_earlier(out, reports)
    for name, recipe in recipes.items():
        if trained_before(runs / name, earlier):
            print(f"skip (done): {name}", file=sys.stderr)
            continue
        print(f"train: {name}{describe(name)}", file=sys.stderr)
        (trainers or {}).get(name, train_eagle31)(recipe)


def write_summary(out: Path, summary: dict, results: str) -> dict:
    """A study's `summary.json` and its `results.md` (the formatted results) under `out`; returns the summary."""

    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "results.md", results + "\n")
    return summary


def report_body(study: Callable, format_results: Callable[[dict], str], trained: Callable) -> Callable:
    """The `study_main` body of a study `study(cfg, overrides, command) -> summary | None` (None: trained only,
    then `trained(cfg)` is printed): its results and the files it wrote."""

    def body(cfg, overrides: list[str], command: str) -> None:
        summary = study(cfg, overrides, command)
        if summary is None:
            print(trained(cfg))
            return
        print(format_results(summary))
        out = Path(cfg.out)
        reports = [p.parent for p in sorted(out.glob("*/*.json")) if p.name in ("acceptance.json", "mt_bench.json")]
        print(f"\nwrote {', '.join(str(p) for p in [out / 'summary.json', out / 'results.md', *reports])}")

    return body


def training_reports(runs: dict[str, Path], out: Path) -> dict:
    """label -> what its run's report.json says of the training; for a run no longer here, what the
    summary under `out` recorded of it (its drafter's measurement is kept too, by `measure_drafters`)."""
    keys = ("steps", "tokens_seen", "train_time_s", "tau_sim", "eval_loss", "documents_per_step")
    earlier_path = out / "summary.json"
    earlier = json.loads(earlier_path.read_text())["training"] if earlier_path.is_file() else {}
    reports = {}
    for label, run in runs.items():
        if (run / "report.json").is_file():
            report = json.loads((run / "report.json").read_text())
            reports[label] = {k: report[k] for k in keys if k in report}
        elif label in earlier:
            reports[label] = {**earlier[label], "earlier": True}
        else:
            raise ConfigError(f"{run / 'report.json'}: missing, and {earlier_path} records no training of {label}")
    return reports


def shared_settings(recipe) -> dict:
    """What every run of a comparison shares, from its composed recipe."""
    from eagle31.recipe import to_container

    settings = to_container(recipe)
    return {
        "recipe": settings["name"],
        "target": settings["target"]["builtin"] or portable_path(settings["target"]["path"]),
        "drafter": settings["drafter"],
        "train": {
            k: settings["train"][k]
            for k in (
                "ttt_length",
                "ttt_decay",
                "loss",
                "lk_eta",
                "lr",
                "betas",
                "weight_decay",
                "warmup_steps",
                "max_steps",
                "max_grad_norm",
                "mask_out_of_vocab",
            )
        },
        "features": {k: settings["features"][k] for k in ("store_dtype", "batching", "tokens_per_batch")},
        "data": {k: settings["data"][k] for k in ("max_len", "eval_fraction")},
    }


def format_training(training: dict) -> list[str]:
    lines = ["", "Training:", "", "| run | steps | tokens | train s | held-out tau_sim |", "|---|---|---|---|---|"]
    for name, t in training.items():
        tau_sim = f"{t['tau_sim']:.3f}" if t.get("tau_sim") is not None else "–"
        earlier = " *" if t.get("earlier") else ""
        lines.append(f"| {name}{earlier} | {t['steps']} | {t['tokens_seen']} | {t['train_time_s']:.0f} | {tau_sim} |")
    if any(t.get("earlier") for t in training.values()):
        lines += [
            "",
            "\\* trained and measured by an earlier run of this comparison, whose run directory is not kept here.",
        ]
    return lines


def study_main(argv: list[str], doc: str, config, smoke: dict, module: str, body: Callable) -> int:
    """`python -m <module> key=value ... [--smoke] [-- recipe overrides]`: parse, then `body(cfg, overrides, command)`
    with the command line to log; a bad key is one line and exit 2, a failure one line and its exit code."""
    if wants_help(argv, doc):
        return 0
    try:
        cfg, overrides = parse_keys_then_overrides(argv, config, smoke)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    command = f"OMP_NUM_THREADS={cfg.threads} python -m {module} " + shlex.join(argv)
    return run_cli(lambda: body(cfg, overrides, command))
