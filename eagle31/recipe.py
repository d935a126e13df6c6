"""Typed run configuration: one dataclass per component, composed by Hydra.

`recipes/config.yaml` starts from `RunConfig` (registered as the structured
schema `eagle31_schema`), and `recipes/recipe/<name>.yaml` overrides it. Every
CLI (`train/main.py`, `data_prep/*.py`, `scripts/*.py`) reads the same tree, so
one recipe describes the target, the data and the drafter for all steps.
Unknown fields are an error (Hydra's structured-config check).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class TargetConfig:
    path: Optional[str] = None  # local HF model directory
    builtin: Optional[str] = None  # "demo" | "kimi_k26_mini": built locally by eagle31.targets (cached)
    config: Optional[str] = None  # a config.json for dry runs without weights
    name: Optional[str] = None  # Hub id for model cards and manifests (e.g. moonshotai/Kimi-K2.6)
    revision: Optional[str] = None
    dtype: str = "bfloat16"
    device_map: Optional[str] = None  # e.g. "auto" for targets larger than one device
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    """Conversations -> tokens + loss masks (data_prep/prepare.py)."""

    source: list[str] = field(default_factory=list)  # JSONL / JSON / Parquet files or `datasets` directories
    prepared_dir: str = "${output_dir}/data"
    system_prompt: Optional[str] = None  # added to conversations that have none
    max_len: int = 2048
    overflow: str = "truncate"  # truncate | drop
    last_turn_only: bool = False  # supervise only the last assistant turn
    eval_fraction: float = 0.05  # held-out split
    eval_max_samples: int = 256
    seed: int = 0


@dataclass
class FeaturesConfig:
    """Target hidden states: captured to a shard store, or computed online; batching."""

    mode: str = "online"  # online | store
    store_dir: str = "${output_dir}/features"
    store_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | float8 (per-row scales)
    shard_max_tokens: int = 1 << 20
    capture_batch_tokens: int = 8192
    batching: str = "pack"  # pack (document ids) | bucket (by length, padded)
    tokens_per_batch: int = 4096  # micro-batch token budget
    skip_corrupt: bool = False  # skip shards whose checksum fails (counted) instead of stopping


@dataclass
class DrafterSection:
    """Overrides of `DrafterConfig.from_target_config`; None keeps the target-derived default."""

    hidden_size: Optional[int] = None
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    draft_vocab_size: int = 32000
    aux_layer_ids: Optional[list[int]] = None
    fc_norm: bool = True
    norm_before_fc: bool = False
    norm_output: bool = True
    norm_before_residual: bool = False
    init_from: Optional[str] = None  # a drafter to fine-tune (any layout eagle31 reads)
    upgrade_to_eagle31: bool = False  # EAGLE 3 checkpoint -> add fc_norm (ones) and norm_output


@dataclass
class TrainConfig:
    ttt_length: int = 7
    ttt_decay: float = 0.8
    mask_out_of_vocab: bool = True
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    max_steps: int = 1000
    grad_accum: int = 1
    max_grad_norm: float = 0.5
    attention: str = "auto"  # auto | flash | blockwise | reference
    activation_checkpointing: bool = False
    compile: bool = False
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 compute on GPU, fp32 on CPU) | bf16 | fp32
    log_every: int = 10
    eval_every: int = 200
    save_every: int = 200
    keep_last: int = 2
    max_nonfinite_steps: int = 5


@dataclass
class ExportConfig:
    formats: list[str] = field(default_factory=lambda: ["eagle3", "speculators"])
    dtype: str = "bfloat16"
    include_embed: bool = False


@dataclass
class EvalConfig:
    """Acceptance by real speculative decoding at the end of a run (scripts/eval_acceptance.py)."""

    enabled: bool = False
    num_speculative_tokens: int = 3
    max_prompts: int = 16
    max_new_tokens: int = 64


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "eagle31"
    entity: Optional[str] = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress: bool = True


@dataclass
class HubConfig:
    license: str = "apache-2.0"
    tags: list[str] = field(default_factory=lambda: ["eagle3", "eagle3.1", "speculative-decoding", "vllm"])


@dataclass
class RunConfig:
    name: str = "demo"
    output_dir: str = "runs/${name}"
    resume: str = "never"  # never | auto
    dry_run: bool = False
    seed: int = 0
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hub: HubConfig = field(default_factory=HubConfig)


def register_schema() -> None:
    """Register `RunConfig` with Hydra's ConfigStore (called by the CLIs)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eagle31_schema", node=RunConfig)


def to_container(cfg: Any) -> dict:
    """A resolved plain-dict copy of an OmegaConf config."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
