"""Read drafters: eagle31's own formats and the ecosystem's EAGLE-3 checkpoints.

`load_drafter(path)` detects the layout from `config.json`, or takes `source_format`:

    eagle31      native (`"format": "eagle31-drafter"`), see `Eagle31Drafter.save`
    eagle3       EAGLE-3 HF layout as vLLM reads it (`LlamaForCausalLMEagle3`, `midlayer.*`),
                 eagle31's own export among them. Aux ids are taken verbatim (vLLM's
                 convention), from `eagle_aux_hidden_state_layer_ids` or `eagle_config`.
    speculators  `speculators_model_type: eagle3`, `transformer_layer_config`, `layers.0.*`.
                 Aux ids verbatim. A missing `norm_before_residual` means true, as vLLM
                 reads this layout.
    specforge    SpecForge's `LlamaForCausalLMEagle3`. Its aux ids (`eagle_config`) mean
                 "output of layer k", so they get +1. `norm_output` is read as false (below).
    torchspec    TorchSpec's `tools/convert_to_hf.py` output (`_torchspec_version` in
                 config.json), weights `midlayer.*` or, with `--vllm`, `layers.0.*`. Aux ids
                 are in TorchSpec's "output of layer k" convention and get +1, except in a
                 `--vllm` export of a `kimi_k2` drafter, which TorchSpec already shifted.

The files are read through their layout (`eagle31.layouts`: speculators', or the EAGLE-3 HF
layout for the other three; SpecForge's and TorchSpec's are its `dialects`), the layer through
the attention kind that recognises it (`eagle31.attention`): an MLA drafter by vLLM's DeepSeek EAGLE-3 architecture or its
`kv_lora_rank`, its fields as transformers' `DeepseekV3Config` (and so vLLM) reads them. The
published Kimi MLA drafters (e.g. `lightseekorg/kimi-k2.6-eagle3.1-mla`) are TorchSpec's:
an MLA config that eagle31 did not write is read as `torchspec` (ids +1, `norm_output`
verbatim; the kind's `unmarked_format`). MLA drafters exist only in the EAGLE-3 HF layout.

Auto-detection, in order: eagle31's `format`; the layout whose mark the config carries
(`eagle31.layouts.layout_of_config`: speculators' `speculators_model_type`), else the EAGLE-3
HF layout, and then its dialect: `_torchspec_version`; eagle31's `eagle31` block (its exports:
none); a kind's unmarked format (MLA: TorchSpec's); ids only under `eagle_config` (SpecForge's
habit); otherwise none, eagle3.

Reading rules:

* SpecForge before its norm_output fix always fed the pre-norm state `o` to the next TTT
  step. Its `norm_output` flag (default true) only chose whether `lm_head` saw
  `norm(o)`. Such a checkpoint is therefore eagle31's `norm_output=False`, and
  `specforge` reads it so. Pass `norm_output=True` for one trained after the fix. A
  SpecForge `norm_output: false` (an `lm_head` without the final norm) is refused.
  `auto` cannot tell such a checkpoint from a vLLM-semantics one. It refuses an HF
  layout that says `norm_output: true` unless eagle31 wrote it: choose `specforge` or
  `eagle3`.
* Missing aux ids: the default `(2, L//2, L-3)` needs `target_num_layers`. Explicit
  `aux_layer_ids` (vLLM convention) override the checkpoint's.
* `target_num_layers` comes from the argument, else eagle31's block. Otherwise it is the
  smallest value the ids allow; it is only used to validate ids.
* Missing `d2t` and `t2d`: the identity map when `Vd == V`, an error otherwise. vLLM
  would map draft id i to target id i, so acceptance would collapse. A missing half is
  derived from the other.
* A rope block that the supported vLLM releases read differently (docs/export.md, the
  rope rule; TorchSpec's Kimi drafters carry one) gives a warning: eagle31 runs the drafter
  with the newest release's reading, and export refuses the block.
* A missing `embed_tokens.weight` stays zero. Copy the target's embedding in before
  running the drafter (vLLM shares the target's).
* `upgrade_to_eagle31=True` turns an EAGLE 3 drafter into a 3.1 one for fine-tuning: it
  adds `fc_norm` (weights at ones) and sets `norm_output`. This changes the drafter's
  outputs from the first step: `fc` now sees unit-RMS chunks and later TTT steps read
  `norm(o)`. Fine-tune before serving.

Weights are read from `*.safetensors`, or from a legacy `pytorch_model.bin` with
`torch.load(weights_only=True)`.
"""

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

# formats whose aux ids mean "output of layer k" (= vLLM id k + 1)
_OUTPUT_OF_LAYER_IDS = ("specforge", "torchspec")
# training-only tensors of the speculators library, never needed for drafting
_IGNORED_KEYS = ("verifier_norm.weight", "verifier_lm_head.weight")


def load_drafter(
    path: str | Path,
    *,
    source_format: str | Layout = "auto",
    device: str | torch.device = "cpu",
    upgrade_to_eagle31: bool = False,
    norm_output: bool | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    target_num_layers: int | None = None,
) -> Eagle31Drafter:
    """Load a drafter directory of any layout eagle31 reads (module docstring).

    source_format: "auto", "eagle31", a layout's name or a dialect's (`eagle31.layouts.source_formats`), or a
    `Layout` (read as its own source format).
    norm_output, aux_layer_ids (vLLM convention), target_num_layers: override what the
    checkpoint says or lacks.
    """
    path = Path(path)
    meta, fmt = _read_meta(path, source_format)
    if fmt == NATIVE:
        drafter = Eagle31Drafter.load(path)
        overrides = {"norm_output": norm_output, "aux_layer_ids": aux_layer_ids, "target_num_layers": target_num_layers}
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if overrides:
            drafter = _with_config(drafter, dataclasses.replace(drafter.config, **overrides))
    else:
        config = drafter_config(
            meta,
            fmt,
            norm_output=norm_output,
            aux_layer_ids=aux_layer_ids,
            target_num_layers=target_num_layers,
            ids_already_shifted=_ids_already_shifted(meta, fmt, path),
        )
        drafter = Eagle31Drafter(config)
        _load_weights(drafter, read_weights(path, source_layout(fmt)), path)
    reason = drafter.config.kind.rope_ambiguity(drafter.config.rope_parameters)
    if reason:
        warnings.warn(
            f"{path}: its rope block is read two ways ({reason}); eagle31 runs it as the newest supported vLLM serves "
            "it, which may not be how it was trained, and will not export it as is"
        )
    if upgrade_to_eagle31:
        drafter = to_eagle31(drafter)
    return drafter.to(device)


def read_drafter_config(
    path: str | Path,
    *,
    source_format: str | Layout = "auto",
    upgrade_to_eagle31: bool = False,
    target_num_layers: int | None = None,
) -> DrafterConfig:
    """The config `load_drafter` gives the drafter at `path`, from its config.json alone (no weights)."""
    path = Path(path)
    meta, fmt = _read_meta(path, source_format)
    if fmt == NATIVE:
        config = DrafterConfig.from_dict(read_native_config(path)["drafter"])
        if target_num_layers is not None:
            config = dataclasses.replace(config, target_num_layers=target_num_layers)
    else:
        config = drafter_config(
            meta, fmt, target_num_layers=target_num_layers, ids_already_shifted=_ids_already_shifted(meta, fmt, path)
        )  # as load_drafter reads them
    return eagle31_config(config) if upgrade_to_eagle31 else config


def _read_meta(path: Path, source_format: str | Layout) -> tuple[dict[str, Any], str | Layout]:
    """(config.json, its source format)."""
    meta = read_json_config(path / "config.json", "drafter config")
    if isinstance(source_format, Layout):
        return meta, source_format
    choices = [AUTO, NATIVE, *source_formats()]
    if source_format not in choices:
        raise ConfigError(f"source_format must be one of {choices}, got {source_format!r}")
    return meta, detect_format(meta, path) if source_format == AUTO else str(source_format)


def to_eagle31(drafter: Eagle31Drafter) -> Eagle31Drafter:
    """EAGLE 3 -> EAGLE 3.1: add `fc_norm` (weights at ones) and set `norm_output` (module docstring)."""
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


# ----------------------------------------------------------------------- config


def detect_format(meta: dict[str, Any], path: Path | str = "") -> str:
    """The source format of a checkpoint from its config.json (module docstring)."""
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
    unmarked = KINDS[DrafterAttention.of_layer(meta)].unmarked_format  # MLA: TorchSpec's (module docstring)
    if unmarked:
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
    meta: dict[str, Any],
    fmt: str | Layout,
    *,
    norm_output: bool | None = None,
    aux_layer_ids: Sequence[int] | None = None,
    target_num_layers: int | None = None,
    ids_already_shifted: bool = False,
) -> DrafterConfig:
    """A `DrafterConfig` from a foreign config.json of format `fmt`: what its layout states (`Layout.read`), in
    the source's conventions (module docstring: aux ids, norm_output) and with the overrides.

    ids_already_shifted: the checkpoint's "output of layer k" ids were already converted to vLLM's.
    """
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


def _ids_already_shifted(meta: dict[str, Any], fmt: str, path: Path) -> bool:
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
        "SpecForge drafter with norm_output=true (its default): read with the pre-norm state fed back (SpecForge before its "
        "norm_output fix); for one trained after it pass norm_output=True (load_drafter) or source_format=eagle3"
    )
    return False  # pre-fix SpecForge fed back the pre-norm state (module docstring)


# ---------------------------------------------------------------------- weights


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
            if name in state:
                raise ConfigError(f"{path}: tensor {key!r} appears twice")
            state[name] = tensor
    return state


def _load_weights(drafter: Eagle31Drafter, state: dict[str, torch.Tensor], path: Path) -> None:
    cfg = drafter.config
    state = dict(state)
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if d2t is None and t2d is None and cfg.draft_vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"{path} has no d2t/t2d but draft_vocab_size={cfg.draft_vocab_size} < vocab_size={cfg.vocab_size}: "
            "the draft-to-target vocabulary map is lost"
        )
    if d2t is None and t2d is None:
        d2t, t2d = torch.zeros(cfg.draft_vocab_size, dtype=torch.long), torch.ones(cfg.vocab_size, dtype=torch.bool)
    elif d2t is None:
        ids = t2d.bool().nonzero().squeeze(1)
        d2t = ids - torch.arange(ids.numel())
    elif t2d is None:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(d2t.numel()) + d2t.long()] = True
    try:
        drafter.set_vocab(d2t.long(), t2d.bool())
    except ConfigError as e:
        raise ConfigError(f"{path}: {e} (draft_vocab_size, vocab_size in config.json)") from None
    missing, unexpected = load_checked_state(drafter, state, path)
    if "embed_tokens.weight" in missing:
        with torch.no_grad():
            drafter.embed_tokens.weight.zero_()  # the target's goes here (module docstring)
    missing = [k for k in missing if k not in ("embed_tokens.weight", "d2t", "t2d")]
    if missing or unexpected:
        raise ConfigError(f"{path}: missing tensors {missing}, unexpected tensors {unexpected}")
