"""One run of a recipe, end to end: prepare → features → train → export → evaluate → report.

`run(cfg)` is what `train/main.py` calls. Everything that can be checked
without building a model is checked first (`plan_run`), so bad input fails
in seconds with one line; `dry_run=true` stops there and prints parameter
counts and a per-GPU memory estimate.

Run directory (`output_dir`):

    config.yaml        the resolved config, secrets redacted
    data/              prepared conversations (unless data.prepared_dir points elsewhere)
    features/          the shard store (features.mode=store)
    metrics.jsonl      one line per logged step
    checkpoints/       step_XXXXXXXX/ (DCP), keep-last-N
    drafter/           the final drafter, native format
    export/<format>/   vLLM layouts
    report.json        final held-out metrics (+ real acceptance when eval.enabled)

The run directory is owned and locked: a folder that eagle31 did not write is refused
(`eagle31.io.check_output_dir`), and rank 0 holds a lock on it for the whole run, so a
second run on the same `output_dir` stops with one line naming the holder. `config.yaml`,
the run's identity, is written only once training starts: a run stopped by a check
(say, data in which nothing is supervised) leaves nothing that blocks its corrected rerun.
"""

from __future__ import annotations

import dataclasses
import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from eagle31.config import ConfigError, DrafterConfig, load_target_config
from eagle31.distributed import World, barrier, close_world, init_world
from eagle31.estimate import count_parameters, estimate_memory
from eagle31.errors import CorruptDataError, RunInterrupted
from eagle31.export import export_config
from eagle31.io import atomic_write_json, atomic_write_text, check_output_dir, claim_output_dir, hold_lock
from eagle31.loss import TargetHead
from eagle31.metrics_log import RunLogger, redact_secrets, truncate_metrics
from eagle31.model import Eagle31Drafter
from eagle31.recipe import to_container
from eagle31.target_weights import read_target_embeddings
from eagle31.trainer import Trainer

# Sections that define a run: resuming with any of them changed is refused.
RUN_IDENTITY = ("target", "drafter", "data.source", "data.max_len", "train.ttt_length")


@dataclass
class RunPlan:
    cfg: Any
    world: World
    run_dir: Path
    target_dir: Path | None  # None in a dry run from a config file alone
    target_config: dict
    drafter: DrafterConfig
    compute_dtype: torch.dtype


def run(cfg) -> dict | None:
    """Run a composed recipe; returns the report (rank 0) or None."""
    world = init_world("cpu" if cfg.dry_run else cfg.train.device)  # a dry run needs no accelerator
    try:
        plan = plan_run(cfg, world)
        if cfg.dry_run:
            return describe_dry_run(plan)
        with hold_run_dir(plan):
            return train_run(plan)
    except KeyboardInterrupt:  # outside the training loop, which says which checkpoint it resumes from
        raise RunInterrupted(
            f"interrupted; what was finished in {cfg.output_dir} (prepared data, captured shards, checkpoints) is kept: "
            "rerun the same command with resume=auto"
        ) from None
    finally:
        close_world()


@contextmanager
def hold_run_dir(plan: RunPlan):
    """Rank 0 creates (or reuses) the run directory, marks it ours and locks it for the run."""
    if not plan.world.is_main:
        yield
        return
    claim_output_dir(plan.run_dir, "run")
    with hold_lock(plan.run_dir):
        check_run_dir(plan)  # again, under the lock: a run may have started since the first check
        yield


# ---------------------------------------------------------------------------- checks


def drafter_overrides(section) -> dict[str, Any]:
    """`drafter.*` fields that are DrafterConfig fields (the rest steer initialisation)."""
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    values = {k: v for k, v in to_container(section).items() if k in names}
    if values.get("aux_layer_ids") is not None:
        values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
    return values


def plan_run(cfg, world: World) -> RunPlan:
    for name in ("ttt_length", "max_steps", "grad_accum"):
        if getattr(cfg.train, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(cfg.train, name)}")
    if not cfg.train.lr > 0:
        raise ConfigError(f"train.lr must be positive, got {cfg.train.lr}")

    target_dir = None
    if cfg.dry_run and cfg.target.config:
        target_config = load_target_config(cfg.target.config)
    else:
        from eagle31.targets import resolve_target_path

        target_dir = Path(resolve_target_path(cfg.target))
        target_config = load_target_config(target_dir)
    drafter = DrafterConfig.from_target_config(target_config, **drafter_overrides(cfg.drafter))
    if cfg.data.max_len > drafter.max_position_embeddings:
        drafter = dataclasses.replace(drafter, max_position_embeddings=int(cfg.data.max_len))
    for fmt in cfg.export.formats:  # an export the run could not write is refused now, not after training
        export_config(drafter, fmt, dtype=cfg.export.dtype, trained_context=int(cfg.data.max_len),
                      target_name_or_path=cfg.target.name or (str(target_dir) if target_dir else None))

    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if world.device.type == "cuda" else "fp32"
    compute_dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    plan = RunPlan(cfg, world, Path(cfg.output_dir), target_dir, target_config, drafter, compute_dtype)
    if not cfg.dry_run:
        check_output_dir(plan.run_dir, "run")
        check_run_dir(plan)
        check_data(plan)
    if cfg.drafter.init_from:
        check_init_from(drafter, cfg.drafter)
    return plan


# A drafter to fine-tune must mean what this run's drafter means: these switch features or
# normalisation without changing a tensor shape, so fitting weights would not catch them.
INIT_FROM_FIELDS = ("aux_layer_ids", "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def check_init_from(drafter: DrafterConfig, section) -> None:
    """`drafter.init_from` (config.json only): its switches and aux ids must be this run's.

    `norm_output` may differ when `drafter.upgrade_to_eagle31` asks for the EAGLE 3 -> 3.1 upgrade.
    """
    from eagle31.convert import read_drafter_config

    source = read_drafter_config(
        section.init_from,
        source_format=section.init_from_format,
        upgrade_to_eagle31=section.upgrade_to_eagle31,
        target_num_layers=drafter.target_num_layers,
    )
    for name in INIT_FROM_FIELDS:
        if name == "norm_output" and section.upgrade_to_eagle31:
            continue
        theirs, ours = getattr(source, name), getattr(drafter, name)
        if theirs != ours:
            theirs, ours = (list(v) if isinstance(v, tuple) else v for v in (theirs, ours))
            raise ConfigError(f"drafter.init_from={section.init_from}: {name} is {theirs} there but {ours} in this run")


def check_run_dir(plan: RunPlan) -> None:
    """An output directory holding another run is refused unless resume=auto continues the same run."""
    saved = plan.run_dir / "config.yaml"
    if not saved.is_file():
        return
    if plan.cfg.resume != "auto":
        raise ConfigError(f"output_dir {plan.run_dir} already holds a run; pass resume=auto to continue it or choose another output_dir")
    from eagle31.export import read_run_config

    old = read_run_config(plan.run_dir)  # a garbled config.yaml is one line naming it
    new = redact_secrets(to_container(plan.cfg))
    for key in RUN_IDENTITY:
        a, b = _get(old, key), _get(new, key)
        if a != b:
            raise ConfigError(f"output_dir {plan.run_dir} holds a different run: {key} was {a!r}, now {b!r}")


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def resolve_sources(sources) -> list[str]:
    """Source paths (one or a list); `demo:<split>` names a split of the demo corpus (built with the demo target)."""
    from eagle31.data.sources import source_paths
    from eagle31.targets import demo_corpus_dir

    prefix = "demo:"
    return [str(demo_corpus_dir() / f"{s[len(prefix):]}.jsonl") if s.startswith(prefix) else s for s in source_paths(sources)]


def data_section(cfg):
    """`cfg.data` with `demo:` sources resolved to files (the recipe keeps the portable names)."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(cfg.data, {"source": resolve_sources(cfg.data.source)})


def check_data(plan: RunPlan) -> None:
    from eagle31.data.prepare import check_data_config
    from eagle31.data.sources import check_sources

    cfg = plan.cfg
    sources = check_data_config(data_section(cfg))
    prepared = Path(cfg.data.prepared_dir)
    check_prepared_dir(prepared, sources)
    if not (prepared / "train").is_dir():
        check_sources(sources)
    if cfg.eval.enabled:
        if not cfg.eval.data:
            raise ConfigError("eval.enabled=true needs eval.data: prompt files, one per split")
        for path in resolve_sources(cfg.eval.data):
            if not Path(path).is_file():
                raise ConfigError(f"eval.data: prompt file not found: {path}")
    if cfg.features.mode == "store":
        from eagle31.data.capture import target_fingerprint
        from eagle31.data.store import check_store_compatible, target_identity

        for split in ("train", "eval"):  # before the target is loaded to capture into them
            check_output_dir(Path(cfg.features.store_dir) / split, "feature-store")
        check_store_compatible(
            Path(cfg.features.store_dir),
            plan.target_config,
            plan.drafter.aux_layer_ids,
            target_name=target_identity(cfg.target),
            target_revision=cfg.target.revision,
            target_fingerprint=target_fingerprint(plan.target_dir),
        )


def check_prepared_dir(prepared: Path, sources: list[str]) -> None:
    """`data.prepared_dir` must be ours (or new), and a prepared one must have been made from `sources`."""
    from eagle31.data.prepare import recorded_sources

    check_output_dir(prepared, "prepared-data")
    recorded = recorded_sources(prepared)
    if recorded is not None and recorded != [str(Path(s).resolve()) for s in sources]:  # the new sources would be ignored
        raise ConfigError(
            f"data.prepared_dir {prepared} was prepared from {recorded}, not from data.source {sources}; "
            "choose another data.prepared_dir (or output_dir), or delete that one to prepare it again"
        )


# ---------------------------------------------------------------------------- dry run


def describe_dry_run(plan: RunPlan) -> dict:
    cfg, d = plan.cfg, plan.drafter
    counts = count_parameters(d)
    world_size = max(plan.world.world_size, 1)
    memory = estimate_memory(
        d,
        cfg.data.max_len,
        cfg.train.ttt_length,
        world_size=world_size,
        activation_checkpointing=cfg.train.activation_checkpointing,
        compute_bytes=4 if cfg.train.precision == "fp32" else 2,  # auto means bf16 on the GPUs planned for
    )
    # build it for real, on the meta device: validates every shape without memory
    with torch.device("meta"):
        model = Eagle31Drafter(d)
    built = sum(p.numel() for p in model.parameters())
    if built != counts.total:
        raise RuntimeError(f"parameter count formula ({counts.total}) disagrees with the model ({built})")
    report = {
        "recipe": cfg.name,
        "drafter": d.to_dict(),
        "parameters": {"trainable": counts.trainable, "frozen_embedding": counts.frozen_embedding, "total": counts.total},
        "memory_gib_per_gpu": memory,
        "seq_len": cfg.data.max_len,
        "ttt_length": cfg.train.ttt_length,
        "world_size": world_size,
    }
    if plan.world.is_main:
        print(f"dry run of recipe {cfg.name!r}: config valid")
        print(f"  drafter: attention={d.attention} H={d.hidden_size} heads={d.num_attention_heads}/{d.num_key_value_heads} head_dim={d.head_dim} "
              f"I={d.intermediate_size} V={d.vocab_size} Vd={d.draft_vocab_size} aux={list(d.aux_layer_ids)} "
              f"fc_norm={d.fc_norm} norm_output={d.norm_output}")  # fmt: skip
        print(f"  parameters: {counts.trainable / 1e6:,.1f}M trainable + {counts.frozen_embedding / 1e6:,.1f}M frozen embedding")
        print(f"  memory per GPU (T={cfg.data.max_len}, K={cfg.train.ttt_length}, {world_size} GPU(s), "
              f"activation checkpointing {'on' if cfg.train.activation_checkpointing else 'off'}): ~{memory['total']:.1f} GiB")  # fmt: skip
        for k, v in memory.items():
            if k != "total":
                print(f"    {k:30s} {v:8.2f} GiB")
    return report


# ---------------------------------------------------------------------------- the run


def train_run(plan: RunPlan) -> dict | None:
    cfg, world = plan.cfg, plan.world
    started = time.time()
    run_dir = plan.run_dir
    prepared = ensure_prepared(plan)
    d2t, t2d = _load_vocab(prepared)
    drafter_cfg = dataclasses.replace(plan.drafter, draft_vocab_size=int(d2t.numel()))
    embed, lm_head = read_target_embeddings(plan.target_dir)

    train_loader, eval_loader = build_loaders(plan, prepared)

    torch.manual_seed(cfg.seed)
    drafter = Eagle31Drafter(drafter_cfg)
    drafter.init_from_target(embed.float(), lm_head.float(), d2t, t2d)
    if cfg.drafter.init_from:
        init_from_checkpoint(drafter, cfg.drafter)
    head = TargetHead(lm_head.to(world.device, plan.compute_dtype), drafter.draft_token_ids().to(world.device))
    del embed

    trainer = Trainer(cfg.train, world, run_dir, drafter, head, train_loader, eval_loader, plan.compute_dtype)
    latest = trainer.checkpoints.latest_intact() if cfg.resume == "auto" else None
    if latest is not None:
        trainer.restore(latest)
        if world.is_main:
            print(f"resumed from {latest} (step {trainer.state.step})")
    if world.is_main:  # the run really starts: its identity, and the metrics of the steps it keeps
        atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(redact_secrets(to_container(cfg)), sort_keys=False))
        truncate_metrics(run_dir / "metrics.jsonl", trainer.state.step)
    logger = RunLogger(
        run_dir,
        to_container(cfg),
        total_steps=cfg.train.max_steps,
        start_step=trainer.state.step,
        is_main=world.is_main,
        wandb_mode=cfg.logging.wandb.mode,
        wandb_project=cfg.logging.wandb.project,
        wandb_entity=cfg.logging.wandb.entity,
        progress=cfg.logging.progress,
    )
    try:
        final = trainer.fit(logger)
        skipped = skipped_features(world, train_loader, eval_loader)  # every rank takes part
        if skipped:
            logger.log(trainer.state.step, {"data/corrupt_shards": len(skipped), "data/skipped_samples": sum(skipped.values())})
            logger.write(f"skipped {len(skipped)} corrupt shard(s), {sum(skipped.values())} samples (features.skip_corrupt): {', '.join(skipped)}")
    except KeyboardInterrupt:
        saved = trainer.checkpoints.latest()
        where = f"rerun with resume=auto to continue from {saved}" if saved else "no checkpoint yet: a rerun starts over"
        raise RunInterrupted(f"interrupted at step {trainer.state.step}; {where}") from None
    finally:
        logger.close()
    state = trainer.full_drafter_state()  # the last collective: every rank takes part
    # Every rank leaves the process group together, here; what follows is rank 0's alone. A rank
    # that tore down gloo while rank 0 was still exporting aborted once (SIGABRT at exit).
    barrier()
    close_world()
    if not world.is_main:
        return None
    trained = Eagle31Drafter(drafter_cfg)  # `drafter` itself is sharded in place under FSDP
    trained.load_state_dict(state)
    report = finish_run(plan, trained, final, trainer, started, skipped)
    print(f"run directory: {run_dir}  (report.json, drafter/, export/)")
    return report


def ensure_prepared(plan: RunPlan) -> Path:
    """Prepare the conversations once (rank 0); every rank then reads them."""
    cfg = plan.cfg
    prepared = Path(cfg.data.prepared_dir)
    if plan.world.is_main and not (prepared / "train").is_dir():
        from transformers import AutoTokenizer

        from eagle31.data.prepare import prepare_dataset

        tokenizer = AutoTokenizer.from_pretrained(plan.target_dir, trust_remote_code=cfg.target.trust_remote_code)
        report = prepare_dataset(data_section(cfg), tokenizer, draft_vocab_size=cfg.drafter.draft_vocab_size, vocab_size=plan.drafter.vocab_size)
        print(report.summary())
    barrier()
    try:
        summary = json.loads((prepared / "report.json").read_text())
    except ValueError:
        raise CorruptDataError(f"{prepared / 'report.json'} is not valid JSON; delete {prepared} to prepare the data again") from None
    if summary["samples"]["train"] == 0 or summary["supervised_tokens"]["train"] == 0:
        raise ConfigError(f"the prepared training split in {prepared} has no supervised token")
    return prepared


def _load_vocab(prepared: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from safetensors.torch import load_file

    vocab = load_file(str(prepared / "vocab.safetensors"))
    return vocab["d2t"], vocab["t2d"]


def build_loaders(plan: RunPlan, prepared: Path):
    """Train and held-out `FeatureLoader`s over online features or the shard store."""
    import datasets

    from eagle31.data.loader import FeatureLoader

    cfg, world = plan.cfg, plan.world
    aux_ids = plan.drafter.aux_layer_ids
    splits = {name: datasets.load_from_disk(str(prepared / name)) for name in ("train", "eval")}
    if cfg.features.mode == "online":
        from eagle31.data.online import OnlineFeatures

        target = load_target_model(plan)
        sources = {n: OnlineFeatures(target, ds, aux_ids, batch_tokens=cfg.features.capture_batch_tokens) for n, ds in splits.items()}
    else:
        from eagle31.data.store import FeatureStore, store_state

        store_dir = Path(cfg.features.store_dir)
        states = {n: store_state(store_dir / n) for n in splits}
        # nothing captured or imported yet, or a capture that was stopped: capture what is missing
        if states["train"] == "missing" or "unfinished" in states.values():
            capture_store(plan, splits, store_dir)
        sources = {n: FeatureStore(store_dir / n, skip_corrupt=cfg.features.skip_corrupt) for n in splits if (store_dir / n / "manifest.json").is_file()}
        if "eval" not in sources:
            splits["eval"] = splits["eval"].select([])  # features imported for train only: no held-out pass
            if world.is_main:
                print(f"no held-out features in {store_dir / 'eval'}: skipping periodic evaluation")
    kwargs = dict(batching=cfg.features.batching, tokens_per_batch=cfg.features.tokens_per_batch, rank=world.rank, world_size=world.world_size)
    train = FeatureLoader(sources["train"], seed=cfg.seed, **kwargs)
    held_out = FeatureLoader(sources["eval"], seed=cfg.seed, **kwargs) if len(splits["eval"]) else None
    return train, held_out


def load_target_model(plan: RunPlan):
    from eagle31.data.capture import load_target

    return load_target(plan.target_dir, plan.cfg.target, plan.world.device)


def capture_store(plan: RunPlan, splits: dict, store_dir: Path) -> None:
    """Capture the target's features into the shard store (each rank its shards)."""
    from eagle31.data.capture import capture_to_store, target_fingerprint
    from eagle31.data.store import StoreWriter

    cfg, world = plan.cfg, plan.world
    fingerprint = target_fingerprint(plan.target_dir)
    writers = {  # each refuses a store made otherwise before the target is loaded
        name: StoreWriter.for_dataset(
            store_dir / name, ds, plan.target_config, plan.drafter.aux_layer_ids, cfg.target, cfg.features, fingerprint=fingerprint
        )
        for name, ds in splits.items()
    }
    target = load_target_model(plan)
    for name, ds in splits.items():
        writer = writers[name]
        stats = capture_to_store(target, ds, writer, batch_tokens=cfg.features.capture_batch_tokens, rank=world.rank, world_size=world.world_size)
        barrier()
        if world.is_main:
            writer.finalize()
            print(f"captured {name}: {stats.summary()}")
        barrier()
    del target


def init_from_checkpoint(drafter: Eagle31Drafter, section) -> None:
    """Fine-tune an existing drafter (any layout eagle31 reads); its vocabulary must match."""
    from eagle31.convert import load_drafter

    source = load_drafter(
        section.init_from,
        source_format=section.init_from_format,
        upgrade_to_eagle31=section.upgrade_to_eagle31,
        target_num_layers=drafter.config.target_num_layers,
    )
    if source.config.draft_vocab_size != drafter.config.draft_vocab_size or not torch.equal(source.d2t, drafter.d2t):
        raise ConfigError(f"drafter.init_from={section.init_from}: its draft vocabulary differs from the prepared one")
    state = {k: v for k, v in source.state_dict().items() if k != "embed_tokens.weight"}
    ours = drafter.state_dict()
    for key, value in state.items():
        if key in ours and ours[key].shape != value.shape:
            raise ConfigError(
                f"drafter.init_from={section.init_from}: {key} is {list(value.shape)} there but {list(ours[key].shape)} in this run"
            )
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "embed_tokens.weight"]:
        raise ConfigError(f"drafter.init_from={section.init_from}: shape/flags differ (missing {missing}, unexpected {unexpected})")


def skipped_features(world: World, *loaders) -> dict[str, int]:
    """{shard: samples} that any rank's store readers skipped as corrupt (`features.skip_corrupt`)."""
    found: dict[str, int] = {}
    for loader in loaders:
        skipped = getattr(getattr(loader, "source", None), "skipped", None)  # online features skip nothing
        if skipped is not None:
            found.update({str(loader.source.root / name): n for name, n in skipped().items()})
    if world.distributed:
        gathered: list[dict[str, int]] = [{} for _ in range(world.world_size)]
        torch.distributed.all_gather_object(gathered, found)
        found = {name: n for ranks in gathered for name, n in ranks.items()}
    return dict(sorted(found.items()))


def finish_run(
    plan: RunPlan, drafter: Eagle31Drafter, final: dict, trainer: Trainer, started: float, skipped: dict[str, int]
) -> dict:
    """Rank 0: native drafter, exports, real acceptance (optional), report.json."""
    from eagle31.export import export_drafter

    cfg, run_dir = plan.cfg, plan.run_dir
    drafter.save(run_dir / "drafter")
    exports = {}
    for fmt in cfg.export.formats:
        exports[fmt] = str(
            export_drafter(
                drafter,
                run_dir / "export" / fmt,
                fmt,
                dtype=cfg.export.dtype,
                include_embed=cfg.export.include_embed,
                trained_context=cfg.data.max_len,
                num_speculative_tokens=cfg.eval.num_speculative_tokens,
                target_name_or_path=cfg.target.name or str(plan.target_dir),
                overwrite=True,  # the run's own exports: a resumed run writes them again
            )
        )
    K = cfg.train.ttt_length
    st = trainer.state
    report = {
        "recipe": cfg.name,
        "steps": st.step,
        "tokens_seen": st.tokens_seen,
        "wall_time_s": time.time() - started,
        "train_time_s": st.train_seconds,
        "tokens_per_s": st.tokens_seen / max(st.train_seconds, 1e-9),
        "tau_sim": final.get("tau_sim"),
        "acc": [final.get(f"acc_{k}") for k in range(K)],
        "cond_acc": [final.get(f"cond_acc_{k}") for k in range(K)],
        "eval_loss": final.get("loss"),
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "exports": exports,
        "skipped_corrupt": {"shards": list(skipped), "samples": sum(skipped.values())},
    }
    if cfg.eval.enabled:
        report["acceptance"] = measure_acceptance(plan)
    atomic_write_json(run_dir / "report.json", report)
    return report


def measure_acceptance(plan: RunPlan) -> dict:
    """Real speculative decoding with the trained drafter on `eval.data` (acceptance/ in the run dir)."""
    from eagle31.acceptance import AcceptanceConfig, run_acceptance
    from eagle31.acceptance_report import write_report

    from eagle31.data.prepare import template_kwargs

    cfg = plan.cfg
    splits = ",".join(f"{Path(p).stem}={p}" for p in resolve_sources(cfg.eval.data))
    result = run_acceptance(
        AcceptanceConfig(
            drafter=str(plan.run_dir / "drafter"),
            target=str(plan.target_dir),
            data=splits,
            chat_template_kwargs=json.dumps(template_kwargs(cfg.data)),  # prompts rendered as for training
            k=cfg.eval.num_speculative_tokens,
            max_new_tokens=cfg.eval.max_new_tokens,
            max_prompts=cfg.eval.max_prompts,
            device=plan.world.device.type,
        )
    )
    write_report(result, plan.run_dir / "acceptance")
    return result
