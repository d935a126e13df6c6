"""Read drafters through their layout (docs/export.md, "Reading the ecosystem's drafters")."""

from __future__ import annotations

import dataclasses
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle31.attention import KINDS, DrafterAttention
from eagle31.config import DrafterConfig, default_aux_layer_ids, read_json_config
from eagle31.errors import ConfigError
from eagle31.layouts import AUTO, NATIVE, Layout, layout_of_config, source_formats, source_layout
from eagle31.layouts.layout import VLLM_PREFIX
from eagle31.model import NATIVE_FORMAT, Eagle31Drafter, load_checked_state, read_native_config, read_safetensors
from eagle31.vocab import vocab_maps

# formats whose aux ids mean "output of layer k" (= vLLM id k + 1)
_OUTPUT_OF_LAYER_IDS = ("specforge", "torchspec")
# training-only tensors of the speculators library, never needed for drafting
_IGNORED_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight")


def load_drafter(
    path: str | Path, *, source_format: str | Layout = "auto", device: str | torch.device = "cpu",
    upgrade_to_eagle31: bool = False, norm_output: bool | None = None, aux_layer_ids: Sequence[int] | None = None,
    target_num_layers: int | None = None,
) -> Eagle31Drafter:  # fmt: skip
    """Load a drafter directory of any format eagle31 reads (`source_format`: auto, eagle31, `source_formats()` or a
    `Layout`); norm_output, aux_layer_ids (vLLM's convention), target_num_layers override what the checkpoint says."""
    path = Path(path)
    overrides = {"norm_output": norm_output, "aux_layer_ids": aux_layer_ids, "target_num_layers": target_num_layers}
    config, fmt = _read_config(path, source_format, overrides)
    if fmt == NATIVE:
        drafter = Eagle31Drafter.load(path)
        if config != drafter.config:  # overridden
            drafter = _with_config(drafter, config)
    else:
        drafter = Eagle31Drafter(config)
        _load_weights(drafter, read_weights(path, source_layout(fmt)), path)
    if reason := drafter.config.kind.rope_ambiguity(drafter.config.rope_parameters):
        warnings.warn(
            f"{path}: its rope block is read two ways ({reason}); eagle31 runs it as the newest supported vLLM serves "
            "it, which may not be how it was trained, and will not export it as is",
            stacklevel=2,
        )
    if upgrade_to_eagle31:
        drafter = to_eagle31(drafter)
    return drafter.to(device)


def read_drafter_config(
    path: str | Path, *, source_format: str | Layout = "auto", upgrade_to_eagle31: bool = False,
    target_num_layers: int | None = None,
) -> DrafterConfig:  # fmt: skip
    """The config `load_drafter` gives the drafter at `path`, from its config.json alone (no weights)."""
    config, _ = _read_config(Path(path), source_format, {"target_num_layers": target_num_layers})
    return eagle31_config(config) if upgrade_to_eagle31 else config


def _read_config(
    path: Path, source_format: str | Layout, overrides: dict[str, Any]
) -> tuple[DrafterConfig, str | Layout]:
    """The drafter's config from its config.json and `overrides` (None: the checkpoint's), and its source format."""
    meta = read_json_config(path / "config.json", "drafter config")
    choices = [AUTO, NATIVE, *source_formats()]
    if not isinstance(source_format, Layout) and source_format not in choices:
        raise ConfigError(f"source_format must be one of {choices}, got {source_format!r}")
    fmt = detect_format(meta, path) if source_format == AUTO else source_format
    if fmt != NATIVE:
        return drafter_config(meta, fmt, **overrides, ids_already_shifted=_ids_already_shifted(meta, fmt, path)), fmt
    try:
        config = DrafterConfig.from_dict(read_native_config(path)["drafter"])
    except TypeError as e:  # a missing or mistyped field
        raise ConfigError(f"{path / 'config.json'}: the drafter block is not a drafter config ({e})") from None
    return dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None}), fmt


def to_eagle31(drafter: Eagle31Drafter) -> Eagle31Drafter:
    """EAGLE 3 -> EAGLE 3.1 for fine-tuning: add `fc_norm` (weights at ones) and set `norm_output`."""
    return _with_config(drafter, eagle31_config(drafter.config))


def eagle31_config(config: DrafterConfig) -> DrafterConfig:
    """The EAGLE 3.1 switches on an EAGLE 3 config (`to_eagle31`'s config)."""
    if config.norm_before_fc:
        raise ConfigError(
            "cannot upgrade a norm_before_fc drafter to EAGLE 3.1: fc_norm and norm_before_fc exclude each other"
        )
    return dataclasses.replace(config, fc_norm=True, norm_output=True)


def _with_config(drafter: Eagle31Drafter, config: DrafterConfig) -> Eagle31Drafter:
    """A new drafter with `config` and `drafter`'s weights; parameters it lacks keep their init."""
    weight = drafter.lm_head.weight
    new = Eagle31Drafter(config).to(device=weight.device, dtype=weight.dtype)
    try:
        missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    except RuntimeError as e:  # shape mismatches
        raise ConfigError(f"the overrides do not fit the drafter's weights: {e}") from None
    if unexpected or any(not k.startswith("fc_norm.") for k in missing):
        raise ConfigError(f"cannot carry the weights over: missing {missing}, unexpected {unexpected}")
    return new


def detect_format(meta: dict[str, Any], path: Path | str = "") -> str:
    """The source format of a checkpoint from its config.json (docs/export.md: the order of the tests)."""
    if meta.get("format") == NATIVE_FORMAT:
        return NATIVE
    layout = layout_of_config(meta)
    dialect = _dialect(meta, layout, path) if layout.dialects else None
    return dialect or layout.name


def _dialect(meta: dict[str, Any], layout: Layout, path: Path | str) -> str | None:
    """Which of `layout`'s dialects (SpecForge's, TorchSpec's) wrote a config in it, None for the layout's own."""
    if "_torchspec_version" in meta:
        return "torchspec"
    if isinstance(meta.get("eagle31"), dict):
        return None
    if unmarked := KINDS[DrafterAttention.of_layer(meta)].unmarked_format:  # MLA: TorchSpec's published drafters
        return unmarked
    nested_ids = (meta.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested_ids and not meta.get("eagle_aux_hidden_state_layer_ids"):
        return "specforge"
    if meta.get("norm_output") is True:
        raise ConfigError(
            f"{path}/config.json says norm_output=true but was not written by eagle31: SpecForge before its fix "
            "trained such drafters feeding back the pre-norm state. Pass source_format='specforge' (pre-norm "
            f"feedback) or source_format='{layout.name}' (post-norm feedback, vLLM's reading)"
        )
    return None


def drafter_config(
    meta: dict[str, Any], fmt: str | Layout, *, norm_output: bool | None = None,
    aux_layer_ids: Sequence[int] | None = None, target_num_layers: int | None = None, ids_already_shifted: bool = False,
) -> DrafterConfig:  # fmt: skip
    """A `DrafterConfig` from a foreign config.json of format `fmt` (`Layout.read`), in the source's conventions and
    with the overrides; `ids_already_shifted`: its "output of layer k" ids are already vLLM's."""
    values = source_layout(fmt).read(meta)
    ids = values["aux_layer_ids"]
    if fmt in _OUTPUT_OF_LAYER_IDS and not ids_already_shifted:
        ids = tuple(i + 1 for i in ids)
    if aux_layer_ids is not None:
        ids = tuple(aux_layer_ids)
    num_layers = target_num_layers or values["target_num_layers"]
    if not ids:
        if not num_layers:
            raise ConfigError(
                "the checkpoint names no aux layer ids: pass aux_layer_ids (vLLM convention) or target_num_layers "
                "for the default (2, L//2, L-3)"
            )
        ids = default_aux_layer_ids(num_layers)
    if norm_output is not None:
        values["norm_output"] = norm_output
    elif fmt == "specforge":
        values["norm_output"] = _specforge_norm_output(meta)
    return DrafterConfig(**{**values, "aux_layer_ids": ids, "target_num_layers": num_layers or max(ids) + 1})


def _ids_already_shifted(meta: dict[str, Any], fmt: str | Layout, path: Path) -> bool:
    """TorchSpec's `--vllm` export (`layers.0.*` weights) of a `kimi_k2` drafter already added 1 to its ids."""
    if fmt != "torchspec" or meta.get("model_type") != "kimi_k2":
        return False
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            if any(key.startswith(VLLM_PREFIX) for key in f.keys()):
                return True
    return False


def _specforge_norm_output(meta: dict[str, Any]) -> bool:
    if meta.get("norm_output", True) is False:
        raise ConfigError(
            "SpecForge norm_output=false means lm_head without the final norm, which eagle31 cannot represent"
        )
    warnings.warn(
        "SpecForge drafter with norm_output=true (its default): read with the pre-norm state fed back (SpecForge "
        "before its norm_output fix); for one trained after it pass norm_output=True (load_drafter) or "
        "source_format=eagle3",
        stacklevel=2,
    )
    return False  # pre-fix SpecForge fed back the pre-norm state


def read_weights(path: Path, layout: Layout) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory in `layout`, under eagle31's names (`Layout.native_key`)."""
    files = sorted(path.glob("*.safetensors"))
    shards = [read_safetensors(f) for f in files]
    if not files:
        legacy = path / "pytorch_model.bin"
        if not legacy.is_file():
            raise ConfigError(f"no *.safetensors or pytorch_model.bin in {path}")
        try:
            shards = [torch.load(legacy, map_location="cpu", weights_only=True)]
        except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(
                f"{legacy} is not a readable PyTorch checkpoint (truncated or corrupt?): {reason}"
            ) from None
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        for key, tensor in shard.items():
            if key in _IGNORED_KEYS or key.endswith("rotary_emb.inv_freq"):
                continue
            name = layout.native_key(key)
            if name == "mask_hidden":  # [1, n·Ht] from any layout's shape (speculators': [1, 1, n·Ht]), as vLLM
                tensor = tensor.reshape(1, -1)
            if name in state:
                raise ConfigError(f"{path}: tensor {key!r} appears twice")
            state[name] = tensor
    return state


def _load_weights(drafter: Eagle31Drafter, state: dict[str, torch.Tensor], path: Path) -> None:
    cfg = drafter.config
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None and t2d is None and cfg.draft_vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"{path} has no d2t/t2d but draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size}: "
            "the draft-to-target vocabulary map is lost"
        )
    if d2t is None and t2d is None:
        d2t, t2d = torch.zeros(cfg.draft_vocab_size, dtype=torch.long), torch.ones(cfg.vocab_size, dtype=torch.bool)
    elif d2t is None:
        d2t, _ = vocab_maps(t2d.bool().nonzero().squeeze(1), t2d.numel())
    elif t2d is None:
        _, t2d = vocab_maps(torch.arange(d2t.numel()) + d2t.long(), cfg.vocab_size)
    try:
        drafter.set_vocab(d2t.long(), t2d.bool())
    except ConfigError as e:
        raise ConfigError(f"{path}: {e} (draft_vocab_size, vocab_size in config.json)") from None
    missing, unexpected = load_checked_state(drafter, state, path)
    if "embed_tokens.weight" in missing:
        with torch.no_grad():
            drafter.embed_tokens.weight.zero_()  # the target's goes here, as vLLM shares it
    missing = [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")]
    if missing or unexpected:
        raise ConfigError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
