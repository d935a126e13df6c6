"""Export a drafter through a `Layout`: every check, then `config.json` and `model.safetensors` (docs/export.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle31.config import DrafterConfig
from eagle31.errors import ConfigError, choose
from eagle31.io import (
    OUTPUT_MARKER,
    ForeignDirectoryError,
    atomic_dir,
    atomic_save_safetensors,
    atomic_write_json,
    check_output_dir,
)
from eagle31.layouts import Layout, layout_of
from eagle31.model import Eagle31Drafter
from eagle31.target import Dtype

WEIGHTS_NAME = "model.safetensors"
EXPORT_CONTENT = "export"  # the kind in an export folder's marker (eagle31.io.OUTPUT_MARKER)
# what an export folder may hold: the export itself and the model card scripts/push_to_hub.py adds
EXPORT_FILES = ("config.json", WEIGHTS_NAME, "README.md", OUTPUT_MARKER)
# the vocabulary maps, written only for a reduced vocabulary (docs/export.md: vLLM 0.33 refuses d2t otherwise)
VOCAB_MAPS = ("d2t", "t2d")


def export_drafter(
    drafter: Eagle31Drafter, out_dir: str | Path, format: str | Layout = "eagle3", *, dtype: str = "bfloat16",
    include_embed: bool | None = None, trained_context: int | None = None, num_speculative_tokens: int = 3,
    target_name_or_path: str | None = None, overwrite: bool = False, source: str | Path | None = None,
) -> Path:  # fmt: skip
    """Write `drafter` to `out_dir` in `format` (a layout's name or a `Layout`), never over `source`, its own folder."""
    out = Path(out_dir)
    check_export_out(out, overwrite=overwrite, source=source)
    config = export_config(
        drafter.config, format, dtype=dtype, trained_context=trained_context,
        num_speculative_tokens=num_speculative_tokens, target_name_or_path=target_name_or_path,
    )  # fmt: skip
    tensors = export_tensors(drafter, format, dtype=dtype, include_embed=include_embed)
    with atomic_dir(out, EXPORT_CONTENT) as tmp:
        atomic_save_safetensors(tensors, tmp / WEIGHTS_NAME, save_file, metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
    return out


def export_tensors(
    drafter: Eagle31Drafter, format: str | Layout, *, dtype: str = "bfloat16", include_embed: bool | None = None
) -> dict[str, torch.Tensor]:
    """The state dict under `format`'s names (`Layout.key`), floats cast to `dtype`, on CPU."""
    layout = layout_of(format)
    torch_dtype = getattr(torch, choose(Dtype, dtype, "export.dtype"))
    check_vocab_maps(drafter)
    with_embed = embed_included(drafter.config, layout, include_embed)
    full_vocab = drafter.config.draft_vocab_size == drafter.config.vocab_size
    out = {}
    for name, tensor in drafter.state_dict().items():
        embed = name == "embed_tokens.weight"
        if (full_vocab and name in VOCAB_MAPS) or (embed and not with_embed):
            continue
        if embed and not tensor.any():
            raise ConfigError(_missing_embed_message(drafter.config, layout, include_embed))
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        out[layout.key(name)] = layout.stored(name, tensor).contiguous()
    return out


def embed_included(config: DrafterConfig, layout: Layout, include_embed: bool | None) -> bool:
    """Whether the export carries `embed_tokens.weight` (docs/export.md, "The embedding": the layout's default)."""
    own = config.target_hidden_size != config.hidden_size
    if include_embed is None:
        return own or layout.embeds_by_default
    if own and not include_embed:
        raise ConfigError(
            f"include_embed=false, but the drafter's hidden_size={config.hidden_size} differs from "
            f"target_hidden_size={config.target_hidden_size}: vLLM would give it the target's embedding, "
            "which is the wrong width. Export it with its own (include_embed=true)"
        )
    return include_embed


def _missing_embed_message(config: DrafterConfig, layout: Layout, include_embed: bool | None) -> str:
    problem = "the drafter's embedding is all zeros (its checkpoint carries none)"
    if config.target_hidden_size != config.hidden_size:
        return (
            f"{problem}, and a drafter whose hidden_size={config.hidden_size} differs from its target's "
            f"({config.target_hidden_size}) cannot share the target's: load its own embedding first"
        )
    if include_embed is None:  # the layout's default
        return (
            f"{problem}; the {layout.name} layout carries it by default. Load the target's embedding into the "
            "drafter first, or pass include_embed=false (vLLM then shares the target's)"
        )
    return f"include_embed=true but {problem}; vLLM would use it instead of the target's. Export without it"


def check_vocab_maps(drafter: Eagle31Drafter) -> None:
    """d2t must name Vd distinct target ids in ascending order, and t2d must mark exactly those."""
    cfg = drafter.config
    ids = drafter.draft_token_ids().cpu()  # [Vd]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size):
        raise ConfigError(f"d2t maps draft ids outside the target vocabulary 0..{cfg.vocab_size - 1}")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ConfigError("d2t does not map draft ids to distinct target ids in ascending order (docs/design.md §5)")
    t2d = drafter.t2d.cpu()
    if int(t2d.sum()) != cfg.draft_vocab_size or not bool(t2d[ids].all()):
        raise ConfigError("t2d disagrees with d2t: it must mark exactly the draft vocabulary's target ids")


def export_config(
    config: DrafterConfig, format: str | Layout, *, dtype: str = "bfloat16", trained_context: int | None = None,
    num_speculative_tokens: int = 3, target_name_or_path: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """`config.json` of `format` for a drafter with `config` (`Layout.config`, after its checks and every layout's)."""
    layout = layout_of(format)
    choose(Dtype, dtype, "export.dtype")
    if config.sliding_window is not None and not config.kind.serves_window:
        raise ConfigError(
            f"drafter.sliding_window={config.sliding_window} cannot be served: vLLM builds {config.kind.label}'s "
            "attention without a window (0.22 to 0.33) and would attend every key. Train it with sliding_window=null, "
            "or a Llama-attention drafter with the window (docs/export.md)"
        )
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
    if reason := config.kind.rope_ambiguity(config.rope_parameters):  # supported vLLM releases read it as other ropes
        raise ConfigError(
            f"drafter.rope_parameters is read two ways: {reason}; the served rope would depend on the vLLM release. "
            "Fine-tune it with drafter.init_from (the drafter then takes a rope read one way) and export that"
        )
    target = target_name_or_path or config.target_name_or_path
    layout.check(config, target)
    return layout.config(config, dtype=dtype, trained_context=trained_context, num_speculative_tokens=k, target=target)


def check_export_out(out: Path, *, overwrite: bool = False, source: str | Path | None = None) -> None:
    """Refuse an output folder that is not ours to replace (docs/export.md, "The output folder"), before any work."""
    if source is not None:
        src, dest = Path(source).resolve(), out.resolve()
        if dest == src or dest in src.parents:
            raise ConfigError(
                f"out={out} is or holds the drafter being exported ({source}); the export would replace it. "
                "Choose another directory"
            )
    try:
        check_output_dir(out, EXPORT_CONTENT)
    except ForeignDirectoryError as e:
        raise ConfigError(f"out: {e}") from None
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"out={out} already holds an eagle31 export; pass overwrite=true to replace it")
    if foreign := sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES and ".tmp-" not in p.name):
        raise ConfigError(
            f"out={out} holds files eagle31 did not write {foreign}; overwrite=true replaces the whole folder, "
            "so move them elsewhere first"
        )


RUN_CONFIG = "config.yaml"  # a run directory: <run>/config.yaml, <run>/drafter/, <run>/report.json
RUN_DRAFTER = "drafter"


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / RUN_CONFIG).is_file() and (path / RUN_DRAFTER).is_dir()


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """A run's `config.yaml` as a resolved plain dict."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(run_dir) / RUN_CONFIG
    try:
        config = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, OmegaConfBaseException, ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"cannot read the run config {path}: {reason}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"the run config {path} is not a mapping of sections (it holds a {type(config).__name__})")
    for section in ("target", "data", "export", "eval"):
        if not isinstance(config.get(section) or {}, dict):
            raise ConfigError(f"the run config {path}: {section} is not a section (got {config[section]!r})")
    return config


def export_options(run_config: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `export_drafter` that a run's resolved config implies."""
    export = run_config.get("export") or {}
    return {
        "dtype": export.get("dtype", "bfloat16"),
        "include_embed": export.get("include_embed"),
        "trained_context": (run_config.get("data") or {}).get("max_len"),
        "num_speculative_tokens": (run_config.get("eval") or {}).get("num_speculative_tokens", 3),
        "target_name_or_path": (run_config.get("target") or {}).get("name"),
    }
