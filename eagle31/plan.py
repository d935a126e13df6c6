"""The plan of a run and every check that needs no model (`plan_run`: bad input fails in seconds); dry runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle31.config import SWITCHES, DrafterConfig
from eagle31.distributed import World
from eagle31.errors import ConfigError
from eagle31.estimate import RunMemory, attention_flops_share, count_parameters, step_flops
from eagle31.export import export_config
from eagle31.io import check_output_dir
from eagle31.metrics_log import redact_secrets
from eagle31.recipe import to_container
from eagle31.target import check_remote_code, load_target_config, target_fingerprint, target_parameters

# what a resumed run must share with the run it continues (the rest may change between attempts): the template
# options decide which tokens the prepared data supervises, and the optimizer that wrote a checkpoint reads it
RUN_IDENTITY = (
    "target",
    "drafter",
    "data.source",
    "data.max_len",
    "data.chat_template_kwargs",
    "train.ttt_length",
    "train.optimizer",
)
# what a config.yaml written before a RUN_IDENTITY field existed ran with
IDENTITY_BEFORE = {"train.optimizer": "adamw"}


@dataclass
class RunPlan:
    """What a run will do, settled before any model is built: the composed config and what it implies."""

    cfg: Any
    world: World
    run_dir: Path
    target_dir: Path | None  # None in a dry run from a config file alone
    target_config: dict
    drafter: DrafterConfig
    compute_dtype: torch.dtype

    @property
    def parts(self) -> dict[str | Path, str]:
        """The outputs this run's own steps (data_prep/*.py) may have written in its directory before it claims it."""
        from eagle31.data.regenerate.shards import OUTPUT_KIND

        cfg, store = self.cfg, Path(self.cfg.features.store_dir)
        parts = {cfg.data.prepared_dir: "prepared-data", cfg.regenerate.output_dir: OUTPUT_KIND}
        return {**parts, **{str(store / split): "feature-store" for split in ("train", "eval")}}


def drafter_overrides(section) -> dict[str, Any]:
    """`drafter.*` fields that are DrafterConfig fields (the rest steer initialisation)."""
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    values = {k: v for k, v in to_container(section).items() if k in names}
    if values.get("aux_layer_ids") is not None:
        values["aux_layer_ids"] = tuple(values["aux_layer_ids"])
    return values


def plan_run(cfg, world: World) -> RunPlan:
    """Everything checkable without building a model; a bad setting is one ConfigError line."""
    for name, least in {"ttt_length": 1, "max_steps": 1, "grad_accum": 1, "lk_eta": 0, "anchor_weight": 0}.items():
        if not getattr(cfg.train, name) >= least:
            raise ConfigError(f"train.{name} must be >= {least}, got {getattr(cfg.train, name)}")
    for name in ("lr", "preempt_grace_s"):
        if not getattr(cfg.train, name) > 0:
            raise ConfigError(f"train.{name} must be positive, got {getattr(cfg.train, name)}")
    check_sequence_parallel(cfg, world)
    check_optimizer(cfg)
    check_engine(cfg)

    target_dir = None
    if cfg.dry_run:
        check_named_paths(cfg)
    if cfg.dry_run and cfg.target.config:
        target_config = load_target_config(cfg.target.config)
    else:
        from eagle31.targets import resolve_target_path

        target_dir = Path(resolve_target_path(cfg.target))
        target_config = load_target_config(target_dir)
    check_remote_code(target_dir or cfg.target.path or cfg.target.config, cfg.target.trust_remote_code)
    drafter = DrafterConfig.from_target_config(target_config, **drafter_overrides(cfg.drafter))
    if cfg.data.max_len > drafter.max_position_embeddings:
        drafter = dataclasses.replace(drafter, max_position_embeddings=int(cfg.data.max_len))
    if drafter.sliding_window is not None and drafter.sliding_window < cfg.train.ttt_length:
        raise ConfigError(
            f"drafter.sliding_window={drafter.sliding_window} must be >= train.ttt_length={cfg.train.ttt_length}: "
            f"step k's query at position p + k sees the step-0 keys of p + k - W + 1 .. p, none past the window"
        )
    target = cfg.target.name or (str(target_dir) if target_dir else None)
    for fmt in cfg.export.formats:  # an export the run could not write is refused now, not after training
        export_config(
            drafter, fmt, dtype=cfg.export.dtype, trained_context=int(cfg.data.max_len), target_name_or_path=target
        )

    precision = cfg.train.precision
    bf16 = precision == "bf16" or (precision == "auto" and world.device.type == "cuda")
    compute_dtype = torch.bfloat16 if bf16 else torch.float32

    plan = RunPlan(cfg, world, Path(cfg.output_dir), target_dir, target_config, drafter, compute_dtype)
    if not cfg.dry_run:
        check_output_dir(plan.run_dir, "run", plan.parts)
        check_run_dir(plan)
        check_data(plan)
    if cfg.drafter.init_from:
        check_init_from(drafter, cfg.drafter)
    return plan


def check_sequence_parallel(cfg, world: World) -> None:
    """`train.sequence_parallel`: >= 1, divides the (planned) world size, and a kernel that takes a shard's queries."""
    n = cfg.train.sequence_parallel
    ranks = cfg.plan.world_size if cfg.dry_run and cfg.plan.world_size > 0 else world.world_size
    if n < 1 or ranks % n:
        raise ConfigError(f"train.sequence_parallel={n} must be >= 1 and divide the world size {ranks}")
    if n > 1 and cfg.train.attention_kernel == "reference":
        raise ConfigError(
            "train.attention_kernel=reference cannot attend across sequence shards; use auto, flash or blockwise "
            "with train.sequence_parallel > 1"
        )


def check_optimizer(cfg) -> None:
    """Muon's settings in range; a `train.anchor_weight` above 0 needs a `drafter.init_from` to anchor to."""
    train = cfg.train
    if train.muon_lr is not None and not train.muon_lr > 0:
        raise ConfigError(f"train.muon_lr must be positive or null, got {train.muon_lr}")
    if not 1 <= train.muon_ns_steps < 100:
        raise ConfigError(f"train.muon_ns_steps must be in 1..99, got {train.muon_ns_steps}")
    if train.anchor_weight > 0 and not cfg.drafter.init_from:
        raise ConfigError(
            f"train.anchor_weight={train.anchor_weight} anchors the weights to drafter.init_from's, and "
            "drafter.init_from is not set: set it, or train.anchor_weight=0"
        )


def check_named_paths(cfg) -> None:
    """A dry run reads no weights or data, but a `target.path` or `data.source` that does not exist is refused."""
    from eagle31.data.sources import resolve_source, source_paths

    if cfg.target.path and not cfg.target.builtin and not Path(cfg.target.path).is_dir():
        raise ConfigError(f"target.path={cfg.target.path!r} is not a directory")
    regenerated = Path(cfg.regenerate.output_dir).absolute()  # data_prep/regenerate.py writes it first
    for source in source_paths(cfg.data.source):
        named = not source.startswith("demo:") and not Path(source).absolute().is_relative_to(regenerated)
        if named and not resolve_source(source).exists():
            raise ConfigError(f"data.source: no such file or directory: {source}")


def check_engine(cfg) -> None:
    """`features.mode=engine`: settings it can run with, and (for a real run) Ray installed."""
    if cfg.features.mode != "engine":
        return
    e = cfg.features.engine
    least = {"workers": 1, "pool_tokens": 1, "max_restarts": 0, "worker_cpus": 0, "worker_gpus": 0}
    for name, at_least in least.items():
        if getattr(e, name) < at_least:
            raise ConfigError(f"features.engine.{name} must be >= {at_least}, got {getattr(e, name)}")
    for name in ("request_timeout_s", "load_timeout_s", "placement_timeout_s"):
        if not getattr(e, name) > 0:
            raise ConfigError(f"features.engine.{name} must be positive, got {getattr(e, name)}")
    if e.pool_tokens < cfg.features.tokens_per_batch:  # a trainer takes a whole micro-batch: the pool must hold one
        raise ConfigError(
            f"features.engine.pool_tokens={e.pool_tokens} holds less than one micro-batch (features.tokens_per_batch="
            f"{cfg.features.tokens_per_batch} tokens), which a trainer takes whole; set features.engine.pool_tokens >= "
            f"{cfg.features.tokens_per_batch}"
        )
    if e.rates_from and not Path(e.rates_from).is_file():
        raise ConfigError(f"features.engine.rates_from: no such file {e.rates_from}")
    if not cfg.dry_run:
        from eagle31.engine.cluster import check_ray_installed
        from eagle31.engine.transport import check_transport

        check_ray_installed()
        check_transport(e)


# A drafter to fine-tune must mean what this run's drafter means: these switch features or
# normalisation without changing a tensor shape, so fitting weights would not catch them.
INIT_FROM_FIELDS = ("aux_layer_ids", "draft_vocab_size", *SWITCHES)


def check_init_from(drafter: DrafterConfig, section) -> None:
    """`drafter.init_from`: switches and aux ids as this run's (`norm_output` may differ with `upgrade_to_eagle31`)."""
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
    if not (plan.run_dir / "config.yaml").is_file():
        return
    if plan.cfg.resume != "auto":
        raise ConfigError(
            f"output_dir {plan.run_dir} already holds a run; pass resume=auto to continue it or choose another "
            "output_dir"
        )
    from eagle31.export import read_run_config

    old = read_run_config(plan.run_dir)  # a garbled config.yaml is one line naming it
    new = redact_secrets(to_container(plan.cfg))
    for key in RUN_IDENTITY:
        a, b = _get(old, key, IDENTITY_BEFORE.get(key)), _get(new, key)
        if a != b:
            raise ConfigError(f"output_dir {plan.run_dir} holds a different run: {key} was {a!r}, now {b!r}")


def _get(tree: dict, dotted: str, absent: Any = None) -> Any:
    """`tree`'s value at a dotted key; `absent` where a part of the key is missing."""
    value: Any = tree
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return absent
        value = value[part]
    return value


def check_data(plan: RunPlan) -> None:
    """Data, held-out prompts and feature store, checked before the target is loaded."""
    from eagle31.data.prepare import check_data_config, recorded_sources
    from eagle31.data.sources import check_sources, data_section, resolve_sources

    cfg = plan.cfg
    sources = check_data_config(data_section(cfg))
    prepared = Path(cfg.data.prepared_dir)
    recorded = recorded_sources(prepared)  # of a prepared directory (`check_data_config` made sure it is one)
    if recorded is not None and recorded != [str(Path(s).resolve()) for s in sources]:  # the new ones would be ignored
        raise ConfigError(
            f"data.prepared_dir {prepared} was prepared from {recorded}, not from data.source {sources}; "
            "choose another data.prepared_dir (or output_dir), or delete that one to prepare it again"
        )
    if not (prepared / "train").is_dir():
        check_sources(sources)
    if cfg.eval.enabled:
        if not cfg.eval.data:
            raise ConfigError("eval.enabled=true needs eval.data: prompt files, one per split")
        for path in resolve_sources(cfg.eval.data):
            if not Path(path).is_file():
                raise ConfigError(f"eval.data: prompt file not found: {path}")
    if cfg.features.mode == "store":
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


# ---------------------------------------------------------------------------- dry run


# memory of one card, GiB, when plan.gpu_memory_gib is not given: 80 GB cards and an H200
_GPU_SIZES_GIB = (80.0, 139.0)


def describe_dry_run(plan: RunPlan) -> dict:
    """`dry_run=true`: print (rank 0) and return parameter counts, a step's FLOPs, per-GPU memory and the longest T."""
    cfg, d, T, K = plan.cfg, plan.drafter, plan.cfg.data.max_len, plan.cfg.train.ttt_length
    counts = count_parameters(d)  # the drafter built on the meta device: every shape checked, no memory
    if cfg.plan.world_size < 0 or cfg.plan.gpu_memory_gib < 0:
        raise ConfigError(
            f"plan.world_size and plan.gpu_memory_gib must be >= 0 (0: the default), got {cfg.plan.world_size} and "
            f"{cfg.plan.gpu_memory_gib}"
        )
    world_size, split = cfg.plan.world_size or max(plan.world.world_size, 1), cfg.train.sequence_parallel
    run_memory = RunMemory(
        d,
        K,
        world_size=world_size,
        activation_checkpointing=cfg.train.activation_checkpointing,
        compute_bytes=4 if cfg.train.precision == "fp32" else 2,  # auto means bf16 on the GPUs planned for
        sequence_parallel=split,
        attention_kernel=cfg.train.attention_kernel,
        online_target_bytes=online_target_bytes(plan),
        anchor=cfg.train.anchor_weight > 0,
    )
    memory = run_memory.at(T)
    flops, attention_share = step_flops(d, T, K), attention_flops_share(d, T, K)
    sizes = (cfg.plan.gpu_memory_gib,) if cfg.plan.gpu_memory_gib else _GPU_SIZES_GIB
    longest = {f"{g:g}": run_memory.longest(g) for g in sizes}
    engine = engine_sizing(plan, world_size)
    report = {
        "recipe": cfg.name,
        "drafter": d.to_dict(),
        "parameters": {**dataclasses.asdict(counts), "total": counts.total},
        "memory_gib_per_gpu": memory,
        "flops_per_sequence": flops,
        "attention_flops_share": attention_share,
        "seq_len": T,
        "ttt_length": K,
        "world_size": world_size,
        "sequence_parallel": split,
        "longest_seq_len_per_gpu_gib": longest,
    }
    if engine is not None:
        report["engine"] = {k: getattr(engine, k) for k in ("workers", "trainers", "measured", "basis")}
    if cfg.features.mode == "store":
        from eagle31.data.store import store_bytes_per_token

        report["store_bytes_per_token"] = store_bytes_per_token(
            d.target_hidden_size, d.num_aux, cfg.features.store_dtype
        )
    if plan.world.is_main:
        heads = f"{d.num_attention_heads}/{d.num_key_value_heads}"
        checkpointing = "on" if cfg.train.activation_checkpointing else "off"
        print(f"dry run of recipe {cfg.name!r}: config valid")
        print(
            f"  drafter: attention={d.attention} H={d.hidden_size} heads={heads} head_dim={d.head_dim} "
            f"I={d.intermediate_size} V={d.vocab_size} Vd={d.draft_vocab_size} aux={list(d.aux_layer_ids)} "
            f"fc_norm={d.fc_norm} norm_output={d.norm_output} sliding_window={d.sliding_window}"
        )
        trainable, frozen = counts.trainable / 1e6, counts.frozen_embedding / 1e6
        print(f"  parameters: {trainable:,.1f}M trainable + {frozen:,.1f}M frozen embedding")
        share = f"{attention_share:.0%} of it attention"
        print(f"  compute: {flops / 1e12:,.1f} TFLOP per T={T} sequence (fwd + bwd), {share}")
        gpus, over = f"{world_size} GPU(s)", f", each sequence split over {split}" if split > 1 else ""
        print(
            f"  memory per GPU (T={T}, K={K}, {gpus}{over}, "
            f"activation checkpointing {checkpointing}): ~{memory['total']:.1f} GiB"
        )
        for k, v in memory.items():
            if k != "total":
                print(f"    {k:30s} {v:8.2f} GiB")
        for g, fitting in longest.items():
            print(
                f"  longest T that fits {gpus} of {g} GiB: {fitting:,}" if fitting else f"  no T fits {gpus} of {g} GiB"
            )
        if engine is not None:
            print(f"  engine: {engine.describe(cfg.features.engine.worker_gpus)}")
        if "store_bytes_per_token" in report:
            per_token = report["store_bytes_per_token"]
            print(
                f"  feature store ({cfg.features.store_dtype}): {per_token / 1024:,.1f} KiB per token, "
                f"{per_token * 1e8 / 2**40:,.2f} TiB per 100M tokens of data"
            )
    return report


def online_target_bytes(plan: RunPlan) -> int:
    """The target's weights on every GPU when `features.mode=online` (the target runs in each trainer), else 0."""
    if plan.cfg.features.mode != "online":
        return 0
    return target_parameters(plan.target_config) * getattr(torch, str(plan.cfg.target.dtype)).itemsize


def engine_sizing(plan: RunPlan, trainers: int):
    """`features.mode=engine`: the workers that keep `trainers` busy, from measured rates or estimated."""
    cfg, engine = plan.cfg, plan.cfg.features.engine
    if cfg.features.mode != "engine":
        return None
    from eagle31.engine.capacity import estimated_sizing, measured_sizing

    for metrics in (engine.rates_from, plan.run_dir / "metrics.jsonl"):
        if metrics and Path(metrics).is_file():
            sizing = measured_sizing(Path(metrics), trainers)
            if sizing is not None:
                return sizing
    T, K = cfg.data.max_len, cfg.train.ttt_length
    return estimated_sizing(plan.target_config, plan.drafter, K, T, trainers, engine.worker_gpus)
