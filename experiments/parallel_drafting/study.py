"""Parallel (P-EAGLE) against chain EAGLE 3.1 drafting: does one forward with a lower tau beat k forwards?

    python -m experiments.parallel_drafting seeds=0,1 ks=3,5,7 out=experiments/parallel_drafting/results/demo \\
        runs=runs/parallel_drafting -- recipe=demo
    python -m experiments.parallel_drafting --smoke ...     # 2 steps, one seed (also SMOKE=1)

One composed recipe for every run (`experiments.harness.comparison_recipe`: the prepared data and shard
store under `runs`, the packed batches in the same order, steps, optimizer and seeds), TTT length
`ttt_length` (>= the largest k, so every measured depth was trained) on every side. The sides differ in
what `recipe=demo_parallel` sets (`PARALLEL`): `chain` is the recipe's EAGLE 3.1 drafter, `parallel` adds
`drafter.parallel_drafting` with P-EAGLE's recipe (COD depth sampling 0.7, floor 0.2, one mean over every
depth's queries), and `speculators` (unless peer=false) is speculators 0.9.0's own P-EAGLE on the parallel
side's recipe (`experiments.side_by_side.study.train_speculators`: their model, forward, COD draw, loss mask
and loss; its rounds cost what the parallel side's do, the same shape). Every drafter is measured, at each k of
`ks`, by one `eagle31.eval.acceptance` run on every `eval.data` split (greedy; each drafter in its own mode:
chains of k, or k tokens from one forward).

Then the costs (`experiments.parallel_drafting.costs`): the first seed's drafters decode `cost_prompts`
prompts of the first split live with the target at each k, timing every target forward and every
drafter call; and the target's plain greedy decoding of the same prompts, timing its one-token forwards.
From tau and the measured costs, per side and k: the speedup over plain decoding
S = tau * T_1 / (T_verify(k) + D(k)), and the crossover: parallel beats chain at the same k when the cost
of one drafter forward over the target's verification exceeds c* = (tau_chain - tau_par) /
(k * tau_par - tau_chain) (one parallel round costing one chain forward, as vLLM runs it at batch 1 on a GPU).

Trained runs are reused and a killed one continues (`resume=auto`); drafters already measured under
`out` are kept (same weights, or a run no longer here), and so are the costs (`costs.json`, same
settings). Writes under `out`: `commands.sh`, `k<k>/` (each acceptance run), `costs.json`,
`summary.json` and `results.md`.

Keys: out, runs, seeds, ks (comma list), ttt_length, max_steps, max_prompts (per split), max_new_tokens,
cost_prompts, threads, measure, peer.
"""

from __future__ import annotations

import datetime
import sys
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

# what recipe=demo_parallel sets over recipe=demo (tests/experiments/test_parallel_drafting.py holds them equal)
PARALLEL = [
    "drafter.parallel_drafting=true",
    "train.ttt_decay=null",
    "train.down_sample_ratio=0.7",
    "train.down_sample_ratio_min=0.2",
]
# every side's overrides: eagle31's chain and parallel drafters, and speculators' own P-EAGLE (`PEagleDraftModel`,
# trained by `experiments.side_by_side.train_speculators` with their forward, COD draw, loss mask and loss) on the
# parallel side's recipe
SIDES = {"chain": [], "parallel": PARALLEL, "speculators": PARALLEL}
PEER = "speculators"
TIMED = ("chain", "parallel")  # the sides whose rounds are timed (`costs.measure_costs`)
# the targets whose drafter/target cost ratio the page gives on paper, from parameter counts (`paper_ratios`)
PAPER_RECIPES = {
    "demo": "the demo target",
    "smollm2_135m": "SmolLM2-135M-Instruct",
    "llama31_8b": "Llama 3.1 8B",
    "kimi_k26_llama": "Kimi K2.6 (Llama-attention drafter)",
}
SMOKE = dict(seeds="0", ks="2,3", ttt_length=3, max_steps=2, max_prompts=2, max_new_tokens=8, cost_prompts=1)


@dataclass
class ParallelDraftingConfig(StudyConfig):
    out: str = "experiments/parallel_drafting/results/demo"
    runs: str = "runs/parallel_drafting"
    ks: str = "3,5,7"  # draft tokens per round: every drafter at every k
    ttt_length: int = 7  # train.ttt_length of both sides: >= the largest k
    cost_prompts: int = 4  # prompts decoded live to time the forwards
    peer: bool = True  # speculators' own P-EAGLE as a third side (false: eagle31's two)

    def __post_init__(self) -> None:
        super().__post_init__()
        ks = self.k_list
        if self.ttt_length < max(ks):
            raise ConfigError(
                f"ttt_length={self.ttt_length} is below the largest k={max(ks)}: every measured depth must be trained"
            )
        if self.cost_prompts < 1:
            raise ConfigError(f"cost_prompts must be a positive integer, got {self.cost_prompts}")

    @property
    def k_list(self) -> list[int]:
        try:
            ks = [int(k) for k in self.ks.split(",") if k.strip()]
        except ValueError:
            raise ConfigError(f"ks must be a comma-separated list of positive integers, got {self.ks!r}") from None
        if not ks or any(k < 1 for k in ks) or len(set(ks)) != len(ks):
            raise ConfigError(f"ks must list distinct positive integers, got {self.ks!r}")
        return ks


def run_name(side: str, seed: int) -> str:
    return f"{side}-s{seed}"


def sides_of(cfg: ParallelDraftingConfig) -> list[str]:
    return [side for side in SIDES if cfg.peer or side != PEER]


def run_dirs(cfg: ParallelDraftingConfig) -> dict[str, Path]:
    """Every run of the study: its name -> its directory under `runs`."""
    return {run_name(side, s): Path(cfg.runs) / run_name(side, s) for side in sides_of(cfg) for s in cfg.seed_list}


def recipes_of(cfg: ParallelDraftingConfig, overrides: list[str]) -> dict:
    """Every run's composed recipe (composed, and so checked, before anything runs)."""
    runs = Path(cfg.runs)
    ttt = [f"train.ttt_length={cfg.ttt_length}"]
    return {
        run_name(side, s): comparison_recipe(
            runs, runs / run_name(side, s), s, cfg.max_steps, [*overrides, *ttt, *SIDES[side]]
        )
        for side in sides_of(cfg)
        for s in cfg.seed_list
    }


def train_runs(cfg: ParallelDraftingConfig, recipes: dict, out: Path) -> None:
    """Train what is missing: eagle31's runs by its pipeline, the peer's by speculators' P-EAGLE."""
    from experiments.side_by_side.study import train_speculators

    peer = {name: lambda r: train_speculators(r, peer_lm_head=False) for name in recipes if name.startswith(f"{PEER}-")}
    # the peer's runs come last (SIDES' order): eagle31's first prepares the data and captures the store they read
    train_missing(
        recipes, Path(cfg.runs), out, lambda name: " (speculators' PEagleDraftModel)" if name in peer else "", peer
    )


def acceptance_rows(cfg: ParallelDraftingConfig, reports: dict[int, dict]) -> list[dict]:
    """Per split, k and side: tau over the seeds (`tau_over_seeds`), the per-position acceptance (mean over the
    seeds: the share of rounds that accept draft position i), and each parallel side against chain (`separation`)."""
    rows = []
    for k, report in reports.items():
        for split in acceptance_splits_of(report):
            taus = {
                side: tau_over_seeds(report, split, [run_name(side, s) for s in cfg.seed_list])
                for side in sides_of(cfg)
            }
            for side in sides_of(cfg):
                per_seed = [
                    r["acceptance_rate"]
                    for r in report["results"]
                    if r["split"] == split and r["drafter"] in {run_name(side, s) for s in cfg.seed_list}
                ]
                row = {"split": split, "k": k, "side": side, **taus[side]}
                row["acceptance_rate"] = [sum(a) / len(a) for a in zip(*per_seed, strict=True)]
                if side != "chain":
                    row["vs_chain"] = row["mean"] / taus["chain"]["mean"]
                    row["separation"] = separation(row, taus["chain"])
                rows.append(row)
    return rows


def crossover(tau_chain: float, tau_parallel: float, k: int, rho: float = 1.0) -> float | None:
    """The drafter/target cost ratio c = (one drafter forward) / (the target's verification) above which one
    parallel forward (costing `rho` chain forwards) beats k chain forwards:
    tau_par / (1 + rho c) > tau_chain / (1 + k c)  <=>  c > (tau_chain - tau_par) / (k tau_par - rho tau_chain).
    0 when parallel wins at any cost ratio, None when it wins at none."""
    gap, slope = tau_chain - tau_parallel, k * tau_parallel - rho * tau_chain
    if gap <= 0:
        return 0.0 if slope >= 0 or gap < 0 else None
    return gap / slope if slope > 0 else None


def speedups(cfg: ParallelDraftingConfig, rows: list[dict], costs: dict, split: str) -> list[dict]:
    """Per k and side on `split`: the measured seconds of a round, tau, and the speedup over plain decoding
    S = tau * T_1 / (T_verify(k) + D(k)); per k the measured cost ratio and the crossover. The peer's drafter has
    the parallel one's shape and drafts in its one forward: its D(k) is the parallel side's."""
    target = costs["target"]
    t1 = target["plain_forward"]["median"]
    tau = {(r["k"], r["side"]): r["mean"] for r in rows if r["split"] == split}
    out = []
    for k in cfg.k_list:
        verify = target["verify"][str(k)]["median"]
        draft = {side: costs["drafters"][run_name(side, cfg.seed_list[0])][str(k)]["round"]["median"] for side in TIMED}
        draft[PEER] = draft["parallel"]
        chain_forward = draft["chain"] / k  # one of the chain's k forwards
        rho = draft["parallel"] / chain_forward  # the parallel round in chain forwards, as measured here
        row = {
            "k": k,
            "verify_s": verify,
            "plain_forward_s": t1,
            "cost_ratio": chain_forward / verify,
            "rho": rho,
            "crossover": crossover(tau[(k, "chain")], tau[(k, "parallel")], k),
            "crossover_at_rho": crossover(tau[(k, "chain")], tau[(k, "parallel")], k, rho),
        }
        for side in sides_of(cfg):
            row[side] = {
                "tau": tau[(k, side)],
                "forwards_per_round": k if side == "chain" else 1,
                "drafter_s": draft[side],
                "speedup": tau[(k, side)] * t1 / (verify + draft[side]),
            }
        row["parallel_over_chain"] = row["parallel"]["speedup"] / row["chain"]["speedup"]
        out.append(row)
    return out


def paper_ratios(recipes: list[str]) -> dict:
    """Per recipe, from parameter counts (`dry_run`'s drafter with parallel drafting on, the target's config): the
    weights one drafter forward reads over those of one target forward (its active decoder parameters and its
    lm_head; the embeddings are a gather): the cost ratio of decoding at batch 1, where reading weights is the cost."""
    from eagle31.distributed import init_world
    from eagle31.engine.capacity import target_active_parameters
    from eagle31.estimate import count_parameters
    from eagle31.plan import plan_run
    from eagle31.recipe import load_recipe
    from eagle31.target import text_config
    from experiments.harness import ROOT

    ratios = {}
    for name in recipes:
        recipe = load_recipe(ROOT / "recipes", [f"recipe={name}", "dry_run=true", "drafter.parallel_drafting=true"])
        plan = plan_run(recipe, init_world("cpu"))
        t = text_config(plan.target_config)
        drafter = count_parameters(plan.drafter).trainable
        target = target_active_parameters(plan.target_config) + int(t["vocab_size"]) * int(t["hidden_size"])
        ratios[name] = {"drafter_parameters": drafter, "target_parameters": target, "cost_ratio": drafter / target}
    return ratios


def parallel_drafting(cfg: ParallelDraftingConfig, overrides: list[str], command: str) -> dict | None:
    """Train what is missing, then measure and summarise (None with measure=false)."""
    import torch

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    recipes = recipes_of(cfg, overrides)
    recipe = next(iter(recipes.values()))
    if not recipe.eval.data:
        raise ConfigError("eval.data names no prompt file: nothing to measure the drafters on")
    out.mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    train_runs(cfg, recipes, out)
    if not cfg.measure:
        return None
    drafters = {name: run / "drafter" for name, run in run_dirs(cfg).items()}
    reports = {
        k: measure_drafters(
            drafters,
            recipe,
            k=k,
            max_new_tokens=cfg.max_new_tokens,
            max_prompts=cfg.max_prompts,
            out=out,
            report_folder=f"k{k}",
        )  # fmt: skip
        for k in cfg.k_list
    }
    rows = acceptance_rows(cfg, reports)
    first = acceptance_splits_of(next(iter(reports.values())))[0]
    timed = (run_name(side, cfg.seed_list[0]) for side in TIMED)
    costs = measured_costs(cfg, recipe, {name: drafters[name] for name in timed}, out)
    shared = shared_settings(recipe)
    for key in ("parallel_drafting", "mask_token_id"):  # per side
        shared["drafter"].pop(key, None)
    for key in ("ttt_decay",):
        shared["train"].pop(key, None)
    summary = {
        "date": datetime.date.today().isoformat(),
        "settings": {**asdict(cfg), "recipe": shared, "sides": {side: SIDES[side] for side in sides_of(cfg)}},
        "first_split": first,
        "acceptance": rows,
        "costs": costs,
        "speedup": speedups(cfg, rows, costs, first),
        "paper_ratios": paper_ratios(list(PAPER_RECIPES)),
        "training": training_reports(run_dirs(cfg), out),
    }
    return write_summary(out, summary, format_results(summary))


def measured_costs(cfg: ParallelDraftingConfig, recipe, drafters: dict[str, Path], out: Path) -> dict:
    """`costs.measure_costs` of the first seed's drafters on the first `eval.data` split, or what `out/costs.json`
    holds for the same settings and weights."""
    import json

    from eagle31.data.prepare import template_kwargs
    from eagle31.eval.acceptance import load_prompts
    from eagle31.io import atomic_write_json
    from eagle31.pipeline import acceptance_splits
    from eagle31.targets import resolve_target_path
    from eagle31.targets.cache import portable_path
    from experiments.harness import drafter_sha256
    from experiments.parallel_drafting.costs import measure_costs

    split, path = acceptance_splits(recipe).split(",")[0].split("=", 1)
    target = Path(resolve_target_path(recipe.target))
    settings = {
        "target": portable_path(target),
        "split": split,
        "prompts": cfg.cost_prompts,
        "ks": cfg.k_list,
        "max_new_tokens": cfg.max_new_tokens,
        "threads": cfg.threads,
        "drafter_sha256": {label: drafter_sha256(p) for label, p in drafters.items()},
    }
    earlier = out / "costs.json"
    if earlier.is_file() and json.loads(earlier.read_text())["settings"] == settings:
        print(f"kept (measured earlier, same settings and weights): {earlier}", file=sys.stderr)
        return json.loads(earlier.read_text())
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = load_prompts(path, tokenizer, cfg.cost_prompts, template_kwargs(recipe.data))
    print(f"costs: {len(prompts)} prompts of {split}, live, k = {cfg.ks}", file=sys.stderr)
    measured = measure_costs(drafters, target, prompts, tokenizer, ks=cfg.k_list, max_new_tokens=cfg.max_new_tokens)
    costs = {"settings": settings, **measured}
    atomic_write_json(earlier, costs)
    return costs


def seeds_cell(row: dict) -> str:
    return f"{row['mean']:.3f} ({', '.join(f'{t:.3f}' for t in row['tau'])})"


def crossover_cell(c: float | None) -> str:
    return "never" if c is None else f"{c:.3f}"


def format_results(summary: dict) -> str:
    cfg, first = summary["settings"], summary["first_split"]
    train = cfg["recipe"]["train"]
    seeds = ", ".join(f"s{s}" for s in cfg["seeds"].split(","))
    rows = {(r["split"], r["k"], r["side"]): r for r in summary["acceptance"]}
    splits = list(dict.fromkeys(r["split"] for r in summary["acceptance"]))
    ks = sorted({r["k"] for r in summary["acceptance"]})
    sides = list(cfg["sides"])
    others = sides[1:]  # the parallel sides, each against the chain
    peer = (
        " speculators: speculators 0.9.0's own P-EAGLE (`PEagleDraftModel`: its forward, COD draw, loss mask and "
        "loss, its trained embedding) on the parallel side's recipe."
        if PEER in sides
        else ""
    )
    lines = [
        f"Chain against parallel (P-EAGLE) EAGLE 3.1 drafters, recipe {cfg['recipe']['recipe']}: "
        f"{train['max_steps']} steps, TTT {train['ttt_length']} on every side; parallel: "
        f"{' '.join(cfg['sides']['parallel'])}.{peer}",
        "",
        f"Acceptance length tau, greedy, {cfg['max_prompts']} prompts per split, {cfg['max_new_tokens']} new tokens "
        f"(mean over seeds; per seed: {seeds}); `/ chain`: the ratio of the means, `higher` / `lower` when every "
        "seed of the side is above / below every seed of chain:",
        "",
        "| split | k | chain tau | " + " | ".join(f"{side} tau | {side} / chain" for side in others) + " |",
        "|---|---|---|" + "---|---|" * len(others),
    ]
    for split in splits:
        for k in ks:
            cells = [seeds_cell(rows[(split, k, "chain")])]
            for side in others:
                row = rows[(split, k, side)]
                versus = f"{row['vs_chain']:.3f}" + (f" ({row['separation']})" if row["separation"] else "")
                cells += [seeds_cell(row), versus]
            lines.append(f"| {split} | {k} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Per-position acceptance on {first} (the share of rounds that accept draft position i; mean over seeds):",
        "",
        "| k | side | " + " | ".join(f"pos {i}" for i in range(1, max(ks) + 1)) + " |",
        "|---|---|" + "---|" * max(ks),
    ]
    for k in ks:
        for side in sides:
            rates = [f"{a:.3f}" for a in rows[(first, k, side)]["acceptance_rate"]] + [""] * (max(ks) - k)
            lines.append(f"| {k} | {side} | " + " | ".join(rates) + " |")
    target = summary["costs"]["target"]
    lines += [
        "",
        f"Measured costs on this CPU ({cfg['cost_prompts']} prompts of {first} decoded live, {cfg['threads']} "
        f"thread(s); medians of every round): the target's one-token forward T_1 = "
        f"{1e3 * target['plain_forward']['median']:.2f} ms; per round its verification of k + 1 tokens T_verify(k) "
        "and the drafter's time D(k) (its draft and the step-0 pass over the verified positions); forwards / round as "
        "vLLM runs them (the chain: the step-0 pass, whose output drafts the first token, then k - 1 steps; parallel: "
        "the verified positions and the k - 1 mask slots in one forward; eagle31's decoder makes that two calls, "
        "`extend` then `draft_parallel`, both in D); speedup over plain decoding S = tau * T_1 / (T_verify(k) + D(k))"
        + (" (speculators' drafter has the parallel one's shape: its D is the parallel side's)" if peer else "")
        + ":",
        "",
        "| k | T_verify ms | side | forwards / round | D ms | tau | S |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary["speedup"]:
        for side in sides:
            x = r[side]
            lines.append(
                f"| {r['k']} | {1e3 * r['verify_s']:.2f} | {side} | {x['forwards_per_round']} | "
                f"{1e3 * x['drafter_s']:.2f} | {x['tau']:.3f} | {x['speedup']:.3f} |"
            )
    lines += [
        "",
        "The crossover: with c = (one drafter forward) / T_verify, parallel beats chain at the same k when "
        "tau_par / (1 + rho c) > tau_chain / (1 + k c), i.e. c > c* = (tau_chain - tau_par) / (k tau_par - rho "
        "tau_chain); rho = 1 (one forward, as at batch 1 on a GPU), and rho and c as measured here (D_par / (D_chain "
        "/ k) and (D_chain / k) / T_verify):",
        "",
        "| k | c* (rho = 1) | c here | rho here | c* at rho here | S par / S chain here |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary["speedup"]:
        lines.append(
            f"| {r['k']} | {crossover_cell(r['crossover'])} | {r['cost_ratio']:.3f} | {r['rho']:.2f} | "
            f"{crossover_cell(r['crossover_at_rho'])} | {r['parallel_over_chain']:.3f} |"
        )
    lines += [
        "",
        "The cost ratio c on paper (weights one drafter forward reads over those one target forward reads, the "
        "embeddings a gather): parallel wins at rho = 1 where c exceeds the k's c* above:",
        "",
        "| target | drafter parameters | target parameters | c | " + " | ".join(f"k = {k}" for k in ks) + " |",
        "|---|---|---|---|" + "---|" * len(ks),
    ]
    crossing = {r["k"]: r["crossover"] for r in summary["speedup"]}
    for name, ratio in summary["paper_ratios"].items():
        verdicts = ["chain" if crossing[k] is None or ratio["cost_ratio"] <= crossing[k] else "parallel" for k in ks]
        lines.append(
            f"| {PAPER_RECIPES.get(name, name)} | {ratio['drafter_parameters'] / 1e6:.1f} M | "
            f"{ratio['target_parameters'] / 1e9:.3f} B | {ratio['cost_ratio']:.4f} | " + " | ".join(verdicts) + " |"
        )
    return "\n".join(lines + format_training(summary["training"]))


def main(argv: list[str]) -> int:
    def trained(cfg: ParallelDraftingConfig) -> str:
        return f"trained chain and parallel drafters, seeds {cfg.seeds}, under {cfg.runs}; measure=true measures them"

    return study_main(
        argv,
        __doc__,
        ParallelDraftingConfig,
        SMOKE,
        "experiments.parallel_drafting",
        report_body(parallel_drafting, format_results, trained),
    )
