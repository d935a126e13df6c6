"""eagle31's trainer against the peers' EAGLE-3 drafters on equal work: `speculators` (3.1 switches), SpecForge.

    python -m experiments.side_by_side                        # recipe=demo, seeds 0 and 1
    python -m experiments.side_by_side --smoke                # tiny budget end to end (also SMOKE=1)
    python -m experiments.side_by_side seeds=0,1 max_steps=150 out=experiments/side_by_side/results/demo \\
        -- recipe=demo train.loss=kl                          # after `--`: recipe overrides, every side
    python -m experiments.side_by_side sides=eagle31,speculators,specforge runs=runs/side_by_side_eagle3 \\
        out=experiments/side_by_side/results/demo_eagle3 -- recipe=demo drafter.norm_output=false

One recipe describes every side: the prepared data and the captured shard store (made once, by
the first eagle31 run, `features.mode=store`), the draft vocabulary, the drafter's shape and
3.1 switches, TTT length and decay, loss kind, batches (`features.tokens_per_batch`, packed, in
the loader's order for the seed), steps, AdamW settings, schedule and clipping. Per seed:
`train/main.py`'s pipeline trains eagle31's drafter (in this process), and
`experiments.side_by_side.peer_training` trains speculators' `Eagle3DraftModel` with its own forward, mask
alignment and loss, and `experiments.side_by_side.specforge_training` runs SpecForge 0.2.0's own trainer
in its venv (what is theirs and what is ours is listed in each). SpecForge trains EAGLE-3
feedback only, so a comparison with it needs `drafter.norm_output=false` (and runs of its own:
finished runs under `runs` are reused, not retrained, whatever the overrides). Every drafter is read
back with `eagle31.convert.load_drafter` and measured by one `eagle31.eval.acceptance` run (greedy
speculative decoding with the target on every `eval.data` split, chains of `k`).

A step whose output exists is skipped, so an interrupted comparison continues, and more seeds add
to it: a run with a `report.json` is not trained again, and a drafter that `acceptance/acceptance.json`
measured with the same settings is not measured again if its weights have the sha256 recorded
there, or if its run directory is gone (a later session adds runs to a comparison whose earlier
runs it no longer holds: such a run is neither trained nor measured again, results.md marks it,
and a changed target decoding is refused). A killed training continues from its last checkpoint
(every `train.save_every` steps; eagle31's by `resume=auto`; SpecForge's starts over). Writes
under `out`: `commands.sh` (what ran), `acceptance/` (JSON, table, plot), `summary.json` and
`results.md` (tau per split and side, the seeds, and per peer the ratio eagle31 / peer of the seed
means and whether eagle31's seeds all lie above or below the peer's).

Keys: out, runs (training run directories), sides (eagle31 and one or more of speculators,
specforge; default eagle31,speculators), seeds, max_steps (train.max_steps of every side), k,
max_prompts (per split), max_new_tokens, threads, peer_lm_head (train speculators' lm_head as
eagle31 does; their trainer freezes it), peer_mask (theirs: speculators' trainer's loss mask, one
token earlier than eagle31's; eagle31: their drafter supervised on exactly eagle31's queries), device
(cpu; cuda: both trainers, each in the recipe's precision with their autocast on theirs, and the
measurement on the GPU; not with SpecForge), measure (false: train only, so that several processes
share the trainings, each its own seeds, and a last run with every seed measures them).
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle31.attention import DrafterAttention
from eagle31.errors import ConfigError
from eagle31.io import atomic_write_json
from experiments.harness import (
    acceptance_splits_of,
    comparison_recipe,
    format_training,
    log_command,
    measure_drafters,
    measured_earlier,
    parse_seeds,
    report_body,
    separation,
    shared_settings,
    study_main,
    tau_over_seeds,
    train_eagle31,
    trained_before,
    training_reports,
    write_summary,
)

SIDES = ("eagle31", "speculators", "specforge")
PEER_NAMES = {"speculators": "speculators 0.9.0", "specforge": "SpecForge 0.2.0"}
PEER_MASKS = ("theirs", "eagle31")  # speculators' loss mask: their trainer's, or eagle31's supervision
SMOKE = dict(seeds="0", max_steps=2, k=2, max_prompts=2, max_new_tokens=8)


@dataclass
class SideBySideConfig:
    out: str = "experiments/side_by_side/results/demo"
    runs: str = "runs/side_by_side"
    sides: str = "eagle31,speculators"
    seeds: str = "0,1"
    max_steps: int | None = None  # None: the recipe's train.max_steps
    k: int = 3
    max_prompts: int = 16
    max_new_tokens: int = 48
    threads: int = 1
    peer_lm_head: bool = False
    peer_mask: str = "theirs"
    device: str = "cpu"  # cuda: both trainers and the measurement on the GPU (the GPU check's part)
    measure: bool = True

    def __post_init__(self) -> None:
        _ = self.seeds_list, self.sides_list  # raise on bad lists
        for name in ("k", "max_prompts", "max_new_tokens", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be cpu or cuda, got {self.device!r}")
        if self.peer_mask not in PEER_MASKS:
            raise ConfigError(f"peer_mask must be one of {', '.join(PEER_MASKS)}, got {self.peer_mask!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps must be a positive integer, got {self.max_steps}")

    @property
    def sides_list(self) -> list[str]:
        sides = [s.strip() for s in self.sides.split(",") if s.strip()]
        unknown = [s for s in sides if s not in SIDES]
        if unknown or "eagle31" not in sides or len(sides) < 2 or len(set(sides)) != len(sides):
            raise ConfigError(f"sides must be eagle31 and one or more of speculators, specforge, got {self.sides!r}")
        return [s for s in SIDES if s in sides]

    @property
    def peers(self) -> list[str]:
        return [s for s in self.sides_list if s != "eagle31"]

    @property
    def seeds_list(self) -> list[int]:
        return parse_seeds(self.seeds)


def run_dir(cfg: SideBySideConfig, side: str, seed: int) -> Path:
    return Path(cfg.runs) / f"{side}-s{seed}"


# ---------------------------------------------------------------------------- the recipe of both sides


def side_recipe(cfg: SideBySideConfig, overrides: list[str], seed: int, side: str):
    """The composed recipe of one run: the user's overrides, then what the comparison fixes."""
    return comparison_recipe(Path(cfg.runs), run_dir(cfg, side, seed), seed, cfg.max_steps, overrides, cfg.device)


def check_recipe(recipe, sides: list[str], prompts: bool = True) -> None:
    """What a peer side cannot do, refused before anything runs; `prompts`: the drafters are measured on eval.data."""
    if "specforge" in sides and recipe.train.device == "cuda":
        raise ConfigError("device=cuda: the SpecForge side trains in its CPU venv; compare it with device=cpu")
    if recipe.drafter.attention != DrafterAttention.llama:
        raise ConfigError(
            f"drafter.attention={recipe.drafter.attention}: the peers' EAGLE-3 drafters have Llama attention only"
        )
    if "specforge" in sides:
        from experiments.side_by_side.specforge_training import check_specforge_recipe, specforge_python

        check_specforge_recipe(recipe)
        specforge_python()  # its venv exists
    if prompts and not recipe.eval.data:
        raise ConfigError("eval.data names no prompt file: nothing to measure the drafters on")


# ---------------------------------------------------------------------------- training


def peer_inputs(recipe):
    """What a peer side trains from: the run plan, our train loader over the store, d2t, t2d, the drafter's shape."""
    from eagle31.data.prepare import load_draft_vocab
    from eagle31.distributed import init_world
    from eagle31.pipeline import build_loaders, prepare_data
    from eagle31.plan import plan_run

    plan = plan_run(recipe, init_world(str(recipe.train.device)))
    prepared = prepare_data(plan)
    train_loader, _ = build_loaders(plan, prepared)  # the store the eagle31 run captured, the same batch order
    d2t, t2d = load_draft_vocab(prepared)
    return plan, train_loader, d2t, t2d, dataclasses.replace(plan.drafter, draft_vocab_size=int(d2t.numel()))


def train_specforge(recipe) -> dict:
    """SpecForge's own trainer on the recipe's prepared data and store; writes drafter/ and report.json."""
    from eagle31.io import claim_output_dir
    from experiments.side_by_side import specforge_training

    plan, train_loader, d2t, t2d, drafter_cfg = peer_inputs(recipe)
    claim_output_dir(plan.run_dir, "run")
    report = specforge_training.train_specforge(recipe, plan, train_loader, d2t, t2d, drafter_cfg)
    atomic_write_json(plan.run_dir / "report.json", report)
    return report


def train_speculators(recipe, peer_lm_head: bool, peer_mask: str = "theirs") -> dict:
    """speculators' drafter on the recipe's prepared data and store; writes drafter/ and report.json.
    peer_mask="eagle31": trained on eagle31's supervised queries (`peer_training.eagle31_loss_mask`)."""
    import torch

    from benchmarks.peer import speculators_drafter
    from eagle31.checkpoint import CheckpointManager
    from eagle31.data.speculators_import import final_norm_weight
    from eagle31.io import claim_output_dir
    from eagle31.loss import TargetHead
    from eagle31.target import read_target_embeddings
    from eagle31.vocab import draft_to_target
    from experiments.side_by_side.peer_training import SpeculatorsTraining

    plan, train_loader, d2t, t2d, drafter_cfg = peer_inputs(recipe)
    mask_head = None
    if peer_mask == "eagle31":
        mask_head = TargetHead(
            read_target_embeddings(plan.target_dir)[1].float(), draft_to_target(torch.arange(d2t.numel()), d2t)
        )
    torch.manual_seed(recipe.seed)
    device = plan.world.device  # their default attention on CUDA (compiled flex); FlexAttention has no CPU backward
    attention = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    model = speculators_drafter(
        drafter_cfg,
        d2t,
        t2d,
        attention=attention,
        ttt_length=recipe.train.ttt_length,
        verifier=str(plan.target_dir),
        device=device,
    )
    if peer_lm_head:
        model.lm_head.weight.requires_grad_(True)
    training = SpeculatorsTraining(
        model,
        recipe.train,
        final_norm_weight(plan.target_dir).float(),
        max_len=recipe.features.tokens_per_batch,
        hidden_size=drafter_cfg.target_hidden_size,
        num_aux=len(drafter_cfg.aux_layer_ids),
        mask_head=mask_head,
        compute_dtype=plan.compute_dtype,
    )
    claim_output_dir(plan.run_dir, "run")
    # every train.save_every steps a checkpoint (the trainer's format): a killed run continues from it
    checkpoints = CheckpointManager(plan.run_dir / "checkpoints", plan.world, keep_last=1)
    latest = checkpoints.latest_intact()
    progress = (
        training.restore(checkpoints, latest, train_loader) if latest else {"steps": 0, "tokens": 0, "seconds": 0.0}
    )
    if latest:
        print(f"resume: speculators seed {recipe.seed} from step {progress['steps']} ({latest})", file=sys.stderr)
    steps, started = progress["steps"], time.perf_counter() - progress["seconds"]
    save_every = recipe.train.save_every
    while steps < recipe.train.max_steps:  # epochs follow each other, as in eagle31's trainer
        for batch in train_loader:
            progress["tokens"] += training.step(batch)["tokens"]
            steps += 1
            if steps == recipe.train.max_steps:
                break
            if save_every and steps % save_every == 0:
                progress.update(steps=steps, seconds=time.perf_counter() - started)
                training.save_checkpoint(checkpoints, train_loader, progress)
    seconds = time.perf_counter() - started
    training.save(plan.run_dir / "drafter")
    report = {
        "steps": steps,
        "tokens_seen": progress["tokens"],
        "train_time_s": seconds,
        "last_step": training.history[-1],
    }
    atomic_write_json(plan.run_dir / "report.json", report)
    return report


# ---------------------------------------------------------------------------- measuring


def measure(cfg: SideBySideConfig, recipe) -> dict:
    """One acceptance run over every drafter of every side (read by eagle31's readers)."""
    drafters = {
        f"{side}-s{seed}": run_dir(cfg, side, seed) / "drafter" for side in cfg.sides_list for seed in cfg.seeds_list
    }
    return measure_drafters(
        drafters,
        recipe,
        k=cfg.k,
        max_new_tokens=cfg.max_new_tokens,
        max_prompts=cfg.max_prompts,
        out=Path(cfg.out),
        device=cfg.device,
    )


def side_rows(acceptance: dict, sides: list[str], seeds: list[int]) -> list[dict]:
    """Per split: tau of each side's drafters (`<side>-s<seed>`) over the seeds, and for each peer eagle31 / peer of
    the means and whether eagle31's seeds all lie above or below the peer's (`separation`); `sides`: eagle31 first."""
    rows = []
    for split in acceptance_splits_of(acceptance):
        row: dict = {"split": split}
        for side in sides:
            row[side] = tau_over_seeds(acceptance, split, [f"{side}-s{s}" for s in seeds])
        row["ratio"] = {peer: row["eagle31"]["mean"] / row[peer]["mean"] for peer in sides[1:]}
        row["separation"] = {peer: separation(row["eagle31"], row[peer]) for peer in sides[1:]}
        rows.append(row)
    return rows


def summarize(cfg: SideBySideConfig, acceptance: dict, recipe) -> dict:
    """Per split: tau of each side per seed, the means, and eagle31 / peer for each peer."""
    rows = side_rows(acceptance, cfg.sides_list, cfg.seeds_list)
    runs = {f"{side}-s{seed}": run_dir(cfg, side, seed) for side in cfg.sides_list for seed in cfg.seeds_list}
    return {
        "date": datetime.date.today().isoformat(),
        "settings": {**asdict(cfg), "sides": ",".join(cfg.sides_list), "recipe": shared_settings(recipe)},
        "acceptance": rows,
        "training": training_reports(runs, Path(cfg.out)),
    }


def format_results(summary: dict) -> str:
    cfg = summary["settings"]
    train = cfg["recipe"]["train"]
    seeds = ", ".join(f"s{s}" for s in cfg["seeds"].split(","))
    sides = cfg["sides"].split(",")
    peers = sides[1:]
    drafter = cfg["recipe"]["drafter"]
    lines = [
        f"eagle31 against {', '.join(PEER_NAMES[p] for p in peers)} (drafters with fc_norm {drafter['fc_norm']}, "
        f"norm_output {drafter['norm_output']}), recipe {cfg['recipe']['recipe']}, "
        f"{train['max_steps']} steps, TTT {train['ttt_length']}, loss {train['loss']}, lr {train['lr']}"
        + (
            f"; speculators' lm_head {'trained' if cfg['peer_lm_head'] else 'frozen (their default)'}"
            if "speculators" in peers
            else ""
        )
        + (
            "; speculators trained on eagle31's loss mask"
            if "speculators" in peers and cfg.get("peer_mask") == "eagle31"
            else ""
        )
        + ".",
        "",
        f"Acceptance length tau, greedy chains of k = {cfg['k']}, {cfg['max_prompts']} prompts per split "
        f"(mean over seeds; per seed: {seeds}):",
        "",
        *side_table(summary["acceptance"], sides),
    ]
    return "\n".join(lines + format_training(summary["training"]))


def side_table(rows: list[dict], sides: list[str]) -> list[str]:
    """`side_rows` as a table: per split, each side's mean tau (each seed's in brackets), eagle31 / peer and whether
    eagle31 is outside the peer's seed spread (higher, lower or no)."""
    peers = sides[1:]
    compared = [f"eagle31 / {p} | outside the spread of {p}" for p in peers]
    lines = [
        "| split | " + " | ".join([*(f"{s} tau" for s in sides), *compared]) + " |",
        "|---|" + "---|" * (len(sides) + 2 * len(peers)),
    ]
    for row in rows:
        cells = [f"{row[s]['mean']:.3f} ({', '.join(f'{t:.3f}' for t in row[s]['tau'])})" for s in sides]
        cells += [f"{row['ratio'][p]:.3f} | {row['separation'][p] or 'no'}" for p in peers]
        lines.append(f"| {row['split']} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------- main


def side_by_side(cfg: SideBySideConfig, overrides: list[str], command: str) -> dict | None:
    """Train what is missing, then measure and summarise (None with measure=false)."""
    import torch

    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    log_command(out, command)
    sides = cfg.sides_list
    recipes = {(side, s): side_recipe(cfg, overrides, s, side) for s in cfg.seeds_list for side in sides}
    check_recipe(recipes[("eagle31", cfg.seeds_list[0])], sides)  # one recipe for all: only output_dir and seed differ
    trainers = {
        "eagle31": train_eagle31,
        "speculators": lambda r: train_speculators(r, cfg.peer_lm_head, cfg.peer_mask),
        "specforge": train_specforge,
    }
    earlier = measured_earlier(out)
    for seed in cfg.seeds_list:
        for side in sides:
            if trained_before(run_dir(cfg, side, seed), earlier):
                print(f"skip (done): {side} seed {seed}", file=sys.stderr)
                continue
            print(f"train: {side} seed {seed}", file=sys.stderr)
            trainers[side](recipes[(side, seed)])
    if not cfg.measure:
        return None
    recipe = recipes[("eagle31", cfg.seeds_list[0])]
    summary = summarize(cfg, measure(cfg, recipe), recipe)
    return write_summary(out, summary, format_results(summary))


def main(argv: list[str]) -> int:
    def trained(cfg: SideBySideConfig) -> str:
        return f"trained seeds {cfg.seeds} of {cfg.sides} under {cfg.runs}; measure=true measures them"

    return study_main(
        argv,
        __doc__,
        SideBySideConfig,
        SMOKE,
        "experiments.side_by_side",
        report_body(side_by_side, format_results, trained),
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
