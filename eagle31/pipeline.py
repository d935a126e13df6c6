"""One run of a recipe (`run`): plan -> prepare -> features -> drafter -> train -> export -> evaluate -> report."""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import yaml

from eagle31.data.capture import capture_splits, check_one_process_per_node, open_store_writers
from eagle31.data.prepare import check_prepared, load_draft_vocab, load_prepared_splits, prepare_with_target_tokenizer
from eagle31.data.sources import data_section, resolve_sources
from eagle31.distributed import all_gather_objects, barrier, close_world, init_world
from eagle31.errors import ConfigError, Eagle31Error, RunInterrupted
from eagle31.io import atomic_write_json, atomic_write_text, claim_output_dir, hold_lock
from eagle31.loss import TargetHead
from eagle31.metrics_log import RunLogger, redact_secrets, truncate_metrics
from eagle31.model import Eagle31Drafter
from eagle31.plan import RunPlan, check_run_dir, describe_dry_run, plan_run
from eagle31.preemption import StopSignals
from eagle31.recipe import to_container
from eagle31.sequence_parallel import SequenceGroup, sequence_group
from eagle31.target import load_recipe_target, read_target_embeddings
from eagle31.trainer import Trainer


def run(cfg) -> dict | None:
    """Run a composed recipe; returns the report (rank 0) or None."""
    # a dry run needs no accelerator; a run watches its ranks (eagle31.distributed.RankWatch)
    world = init_world("cpu" if cfg.dry_run else cfg.train.device, None if cfg.dry_run else cfg.train.rank_timeout_s)
    left = "finished"
    try:
        plan = plan_run(cfg, world)
        if cfg.dry_run:
            return describe_dry_run(plan)
        with hold_run_dir(plan):
            return train_run(plan)
    except KeyboardInterrupt:  # outside the training loop, which says which checkpoint it resumes from
        left = "interrupted"
        raise RunInterrupted(
            f"interrupted; what was finished in {cfg.output_dir} (prepared data, captured shards, checkpoints) is "
            "kept: rerun the same command with resume=auto"
        ) from None
    except BaseException as e:
        left = " ".join(str(e).split())[:300] or type(e).__name__
        if world.watch is not None and not isinstance(e, Eagle31Error):
            world.watch.explain(e)  # a collective failed: when a rank was lost, the watch's line names it (and exits)
        raise
    finally:
        close_world(world, left)
        # FSDP's modules are reference cycles that keep the process group alive: freed at interpreter exit, a gloo
        # group's threads reach for a Python that is gone (SIGABRT). Free them while the interpreter is whole.
        gc.collect()


@contextmanager
def hold_run_dir(plan: RunPlan):
    """Rank 0 creates (or reuses) the run directory, marks it ours and locks it for the run."""
    if not plan.world.is_main:
        yield
        return
    claim_output_dir(plan.run_dir, "run", plan.parts)
    with hold_lock(plan.run_dir):
        check_run_dir(plan)  # again, under the lock: a run may have started since the first check
        yield


def train_run(plan: RunPlan) -> dict | None:
    """The steps of a planned run; every rank takes part until the drafter is gathered."""
    started = time.time()
    prepared = prepare_data(plan)
    sequence = sequence_group(plan.world, plan.cfg.train.sequence_parallel)  # the (data x sequence) mesh
    with ExitStack() as stack:  # the inference engine of features.mode=engine lives until training ends
        engine = None
        if plan.cfg.features.mode == "engine":  # its workers and their pool (`eagle31.engine`, imported only then)
            from eagle31.engine.features import open_engine

            engine = stack.enter_context(open_engine(plan, prepared, sequence))
        train_loader, eval_loader = build_loaders(plan, prepared, sequence, engine)
        drafter, head = build_drafter(plan, prepared)
        trainer = build_trainer(plan, drafter, head, train_loader, eval_loader, sequence)
        if engine is not None:
            engine.start(train_loader)  # from the restored position, once its workers hold the target
        final, skipped = train(plan, trainer, train_loader, eval_loader)
        state = trainer.full_drafter_state()  # the last collective: every rank takes part
        barrier()  # every rank leaves the process group together, here; what follows is rank 0's alone
    close_world(plan.world)
    if not plan.world.is_main:
        return None
    trained = Eagle31Drafter(drafter.config)  # `drafter` itself is sharded in place under FSDP
    trained.load_state_dict(state)
    report = finish_run(plan, trained, final, trainer, started, skipped)
    print(f"run directory: {plan.run_dir}  (report.json, drafter/, export/)")
    return report


def prepare_data(plan: RunPlan) -> Path:
    """Prepare the conversations once (rank 0); every rank then reads them."""
    cfg = plan.cfg
    prepared = Path(cfg.data.prepared_dir)
    if plan.world.is_main and not (prepared / "train").is_dir():
        assert plan.target_dir is not None  # plan_run resolved it: a run has a target
        report = prepare_with_target_tokenizer(
            data_section(cfg),
            plan.target_dir,
            trust_remote_code=cfg.target.trust_remote_code,
            draft_vocab_size=cfg.drafter.draft_vocab_size,
            vocab_size=plan.drafter.vocab_size,
            draft_vocab=init_from_vocab(cfg.drafter, plan.target_dir),
        )
        print(report.summary())
    barrier()
    check_prepared(prepared)
    return prepared


def build_loaders(plan: RunPlan, prepared: Path, sequence: SequenceGroup | None = None, engine=None):
    """Train and held-out `FeatureLoader`s over online features, the `engine` (`features.mode=engine`) or the shard
    store, batches split over the data axis of `sequence` (default: every rank its own)."""
    from eagle31.data.loader import FeatureLoader, FeatureSource

    cfg, world = plan.cfg, plan.world
    sources: dict[str, FeatureSource]
    splits = load_prepared_splits(prepared)
    if cfg.features.mode == "online":
        from eagle31.data.online import OnlineFeatures

        check_one_process_per_node(world, cfg.target, "use features.mode=store or engine (docs/kimi_k26.md)")
        target = load_recipe_target(plan.target_dir, cfg.target, world.device)
        sources = {
            n: OnlineFeatures(target, ds, plan.drafter.aux_layer_ids, batch_tokens=cfg.features.capture_batch_tokens)
            for n, ds in splits.items()
        }
    elif cfg.features.mode == "engine":
        sources = engine.sources(splits)
    else:
        from eagle31.data.store import FeatureStore, store_state

        store_dir = Path(cfg.features.store_dir)
        states = {n: store_state(store_dir / n) for n in splits}
        # nothing captured or imported yet, or a capture that was stopped: capture what is missing
        if states["train"] == "missing" or "unfinished" in states.values():
            capture_store(plan, splits, store_dir)
        sources = {
            n: FeatureStore(store_dir / n, skip_corrupt=cfg.features.skip_corrupt)
            for n in splits
            if (store_dir / n / "manifest.json").is_file()
        }
        if "eval" not in sources and world.is_main:  # features imported for train only: no held-out pass
            print(f"no held-out features in {store_dir / 'eval'}: skipping periodic evaluation")
    rank, ranks = (sequence.data_rank, sequence.data_size) if sequence else (world.rank, world.world_size)
    f = cfg.features
    kwargs = dict(batching=f.batching, tokens_per_batch=f.tokens_per_batch, seed=cfg.seed, rank=rank, world_size=ranks)
    train = FeatureLoader(sources["train"], **kwargs)
    held_out = FeatureLoader(sources["eval"], **kwargs) if "eval" in sources and len(splits["eval"]) else None
    return train, held_out


def capture_store(plan: RunPlan, splits: dict, store_dir: Path) -> None:
    """Capture the target's features into the shard store (each rank its shards)."""
    cfg = plan.cfg
    check_one_process_per_node(
        plan.world, cfg.target, f"capture {store_dir} first (data_prep/capture.py, docs/kimi_k26.md), then train"
    )
    writers = open_store_writers(
        store_dir, splits, plan.target_dir, plan.target_config, plan.drafter.aux_layer_ids, cfg.target, cfg.features
    )
    target = load_recipe_target(plan.target_dir, cfg.target, plan.world.device)
    capture_splits(target, splits, writers, batch_tokens=cfg.features.capture_batch_tokens, world=plan.world)


def build_drafter(plan: RunPlan, prepared: Path) -> tuple[Eagle31Drafter, TargetHead]:
    """The drafter (from the target's embedding and lm_head, or `drafter.init_from`) and the frozen target head."""
    cfg, world = plan.cfg, plan.world
    d2t, t2d = load_draft_vocab(prepared)
    drafter_cfg = dataclasses.replace(plan.drafter, draft_vocab_size=int(d2t.numel()))
    assert plan.target_dir is not None  # plan_run resolved it: a run has a target
    embed, lm_head = read_target_embeddings(plan.target_dir)
    torch.manual_seed(cfg.seed)
    drafter = Eagle31Drafter(drafter_cfg)
    drafter.init_from_target(embed.float(), lm_head.float(), d2t, t2d)
    if cfg.drafter.init_from:
        init_from_checkpoint(drafter, cfg.drafter)
    head = TargetHead(lm_head.to(world.device, plan.compute_dtype), drafter.draft_token_ids().to(world.device))
    return drafter, head


def build_trainer(
    plan: RunPlan, drafter: Eagle31Drafter, head: TargetHead, train_loader, eval_loader, sequence: SequenceGroup
) -> Trainer:
    """The trainer, resumed from the newest intact checkpoint under `resume=auto`."""
    cfg, world = plan.cfg, plan.world
    trainer = Trainer(
        cfg.train, world, plan.run_dir, drafter, head, train_loader, eval_loader, plan.compute_dtype, sequence
    )
    latest = trainer.checkpoints.latest_intact() if cfg.resume == "auto" else None
    if latest is not None:
        trainer.restore(latest)
        if world.is_main:
            print(f"resumed from {latest} (step {trainer.state.step})")
    if world.is_main:  # the run really starts: its identity, and the metrics of the steps it keeps
        atomic_write_text(
            plan.run_dir / "config.yaml", yaml.safe_dump(redact_secrets(to_container(cfg)), sort_keys=False)
        )
        truncate_metrics(plan.run_dir / "metrics.jsonl", trainer.state.step, evaluated=not trainer.state.eval_due)
    return trainer


def train(plan: RunPlan, trainer: Trainer, train_loader, eval_loader) -> tuple[dict, dict[str, int]]:
    """(final held-out metrics, corrupt shards skipped); Ctrl-C says where the run resumes."""
    cfg = plan.cfg
    wandb, start = cfg.logging.wandb, trainer.state.step
    logger = RunLogger(
        plan.run_dir,
        to_container(cfg),
        total_steps=cfg.train.max_steps,
        start_step=start,
        is_main=plan.world.is_main,
        wandb_mode=wandb.mode,
        wandb_project=wandb.project,
        wandb_entity=wandb.entity,
        progress=cfg.logging.progress,
    )
    try:
        with StopSignals(cfg.train.preempt_grace_s, trainer.checkpoints.root) as stop:
            final = trainer.fit(logger, stop)
        skipped = skipped_features(train_loader, eval_loader)  # every rank takes part
        if skipped:
            shards, samples = len(skipped), sum(skipped.values())
            logger.log(trainer.state.step, {"data/corrupt_shards": shards, "data/skipped_samples": samples})
            said = f"skipped {shards} corrupt shard(s), {samples} samples (features.skip_corrupt): "
            logger.write(said + ", ".join(skipped))
    except KeyboardInterrupt:
        saved = trainer.checkpoints.latest()
        where = (
            f"rerun with resume=auto to continue from {saved}" if saved else "no checkpoint yet: a rerun starts over"
        )
        raise RunInterrupted(f"interrupted at step {trainer.state.step}; {where}") from None
    finally:
        logger.close()
    return final, skipped


def init_from_vocab(section, target_dir: Path):
    """(d2t, t2d) of `drafter.init_from`, the draft vocabulary its fine-tuning keeps; None without one."""
    from eagle31.config import text_config
    from eagle31.convert import load_drafter
    from eagle31.target import load_target_config

    if not section.init_from:
        return None
    layers = text_config(load_target_config(target_dir))["num_hidden_layers"]
    source = load_drafter(section.init_from, source_format=section.init_from_format, target_num_layers=layers)
    return source.d2t, source.t2d


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
                f"drafter.init_from={section.init_from}: {key} is {list(value.shape)} there but "
                f"{list(ours[key].shape)} in this run"
            )
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "embed_tokens.weight"]:
        raise ConfigError(
            f"drafter.init_from={section.init_from}: shape/flags differ (missing {missing}, unexpected {unexpected})"
        )


def skipped_features(*loaders) -> dict[str, int]:
    """{shard: samples} that any rank's store readers skipped as corrupt (`features.skip_corrupt`)."""
    found: dict[str, int] = {}
    for loader in loaders:
        skipped = getattr(getattr(loader, "source", None), "skipped", None)  # online features skip nothing
        if skipped is not None:
            found.update({str(loader.source.root / name): n for name, n in skipped().items()})
    found = {name: n for ranks in all_gather_objects(found) for name, n in ranks.items()}
    return dict(sorted(found.items()))


def finish_run(
    plan: RunPlan, drafter: Eagle31Drafter, final: dict, trainer: Trainer, started: float, skipped: dict[str, int]
) -> dict:
    """Rank 0: native drafter, exports, real acceptance (optional), report.json."""
    from eagle31.export import export_drafter, export_options

    cfg, run_dir, st = plan.cfg, plan.run_dir, trainer.state
    drafter.save(run_dir / "drafter")
    # overwrite: the run's own exports, which a resumed run writes again
    options = {**export_options(to_container(cfg)), "overwrite": True}
    options["target_name_or_path"] = cfg.target.name or str(plan.target_dir)
    exports = {f: str(export_drafter(drafter, run_dir / "export" / f, f, **options)) for f in cfg.export.formats}
    report = {
        "recipe": cfg.name,
        "steps": st.step,
        "tokens_seen": st.tokens_seen,
        "wall_time_s": time.time() - started,
        "train_time_s": st.train_seconds,
        "tokens_per_s": st.tokens_seen / max(st.train_seconds, 1e-9),
        "tau_sim": final.get("tau_sim"),
        "acc": [final.get(f"acc_{k}") for k in range(cfg.train.ttt_length)],
        "cond_acc": [final.get(f"cond_acc_{k}") for k in range(cfg.train.ttt_length)],
        "eval_loss": final.get("loss"),
        "draft_vocab_size": drafter.config.draft_vocab_size,
        "exports": exports,
        "skipped_corrupt": {"shards": list(skipped), "samples": sum(skipped.values())},
    }
    if cfg.eval.enabled:  # real speculative decoding with the trained drafter on `eval.data`
        from eagle31.eval.acceptance import run_acceptance
        from eagle31.eval.acceptance_report import write_report

        assert plan.target_dir is not None  # plan_run resolved it: a run has a target
        report["acceptance"] = run_acceptance(acceptance_config(cfg, run_dir, plan.target_dir, plan.world.device.type))
        write_report(report["acceptance"], run_dir / "acceptance")
    atomic_write_json(run_dir / "report.json", report)
    return report


def acceptance_config(cfg, run_dir: Path, target_dir: Path, device: str):
    """The `AcceptanceConfig` of a run's drafter (`eval.*`, prompts rendered as for training), as `finish_run`'s."""
    from eagle31.data.prepare import template_kwargs
    from eagle31.eval.acceptance import AcceptanceConfig

    return AcceptanceConfig(
        drafter=str(Path(run_dir) / "drafter"),
        target=str(target_dir),
        data=acceptance_splits(cfg),
        chat_template_kwargs=json.dumps(template_kwargs(cfg.data)),
        k=cfg.eval.num_speculative_tokens,
        max_new_tokens=cfg.eval.max_new_tokens,
        max_prompts=cfg.eval.max_prompts,
        device=device,
    )


def acceptance_splits(cfg) -> str:
    """`eval.data` as `AcceptanceConfig.data`: `name=path` per prompt file (`demo:` names resolved)."""
    return ",".join(f"{Path(p).stem}={p}" for p in resolve_sources(cfg.eval.data))
