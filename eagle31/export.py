"""Export a drafter in vLLM's two layouts (docs/design.md §6): a config writer and a rename table.

    eagle3       EAGLE-3 HF layout: `LlamaForCausalLMEagle3`, weights `midlayer.*`
                 (vLLM >= 0.22 reads the EAGLE 3.1 flags)
    speculators  the `speculators` library layout: `speculators_model_type: eagle3`,
                 `transformer_layer_config`, weights `layers.0.*` (vLLM >= 0.25)

Both write `config.json` and `model.safetensors` atomically, after every check has
passed. The checks and fields guard against the ways a drafter silently fails in vLLM
(read from vLLM's `llama_eagle3.py` and its speculators config handling, and encoded in
`tests/export/vllm_contract.py`):

* `fc_norm`, `norm_output`, `norm_before_fc` and `norm_before_residual` are always
  written. vLLM defaults the 3.1 flags to false, and `norm_before_residual` to false
  in the HF layout but to *true* in the speculators layout.
* `eagle_aux_hidden_state_layer_ids` is written at the top level, in vLLM's convention
  (vLLM reads it verbatim to pick the target layers). SGLang's nested
  `eagle_config.eagle_aux_hidden_state_layer_ids` means "output of layer k" and is not
  written. `num_aux_hidden_states` is always written: vLLM sizes `fc` and `fc_norm` from
  it and otherwise assumes 3. In the speculators layout it sits in
  `transformer_layer_config`, the only block vLLM copies whole.
* `d2t` is always written and checked against `t2d` (without it vLLM maps draft id i to
  target id i and acceptance collapses).
* `target_hidden_size` is written only when it differs from `hidden_size`: vLLM reads
  `getattr(config, "target_hidden_size", hidden_size)`, so a `null` breaks it.
* `max_position_embeddings` is at least the trained context. A lower value is raised
  to it rather than failing at the end of a run. Rope types whose frequencies depend on
  it (yarn, dynamic, longrope) then get the old value pinned as
  `original_max_position_embeddings`, so the rope is unchanged.
* The rope is written in both forms: `rope_theta` + `rope_scaling` (transformers 4
  readers) and `rope_parameters` (transformers 5). They always agree, because
  transformers 5 lets `rope_scaling` win when both are present.
* Safetensors metadata `{"format": "pt"}` is set, because transformers-based readers
  (the `speculators` library) refuse files without it.
* The output folder must hold no other weight files: vLLM loads every `*.safetensors`
  it finds.

Both layouts also carry an `eagle31` block (format version, target layer count, name,
architectures) that `eagle31.convert.load_drafter` uses to read them back exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle31.config import ConfigError, DrafterConfig
from eagle31.io import atomic_save_safetensors, atomic_write_json
from eagle31.model import Eagle31Drafter
from eagle31.recipe import Dtype, ExportFormat, choose

DTYPES = {d: getattr(torch, d) for d in Dtype}
HF_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EXPORT_FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
# the decoder layer's key prefix per layout; everything else keeps eagle31's (= HF) names
LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}
# rope types whose frequencies read max_position_embeddings when original_max_position_embeddings is absent
_ROPE_TYPES_READING_MAX_POSITIONS = ("yarn", "dynamic", "longrope")


def export_drafter(
    drafter: Eagle31Drafter,
    out_dir: str | Path,
    format: str = "eagle3",
    *,
    dtype: str = "bfloat16",
    include_embed: bool = False,
    trained_context: int | None = None,
    num_speculative_tokens: int = 3,
    target_name_or_path: str | None = None,
) -> Path:
    """Write `drafter` to `out_dir` in `format` ("eagle3" | "speculators"); returns `out_dir`.

    dtype: "bfloat16" | "float16" | "float32" for the floating-point weights (d2t stays
    int64, t2d bool). include_embed: also write the (frozen, target's) embedding; vLLM
    shares the target's when it is absent. trained_context: the longest training
    sequence (`data.max_len`). num_speculative_tokens: the k written in the speculators
    layout. target_name_or_path: the target's Hub id (default: the drafter config's).
    """
    out = Path(out_dir)
    config = export_config(
        drafter.config,
        format,
        dtype=dtype,
        trained_context=trained_context,
        num_speculative_tokens=num_speculative_tokens,
        target_name_or_path=target_name_or_path,
    )
    tensors = export_tensors(drafter, format, dtype=dtype, include_embed=include_embed)
    check_out_dir(out)
    atomic_save_safetensors(tensors, out / WEIGHTS_NAME, save_file, metadata={"format": "pt"})
    atomic_write_json(out / "config.json", config)
    return out


# ----------------------------------------------------------------------- weights


def layout_key(name: str, format: str) -> str:
    """eagle31 parameter name -> its name in `format` (the whole rename table)."""
    native = LAYER_PREFIX["eagle3"]
    if name.startswith(native):
        return LAYER_PREFIX[format] + name[len(native) :]
    return name


def native_key(name: str) -> str:
    """A key of either layout -> the eagle31 parameter name."""
    for prefix in LAYER_PREFIX.values():
        if name.startswith(prefix):
            return LAYER_PREFIX["eagle3"] + name[len(prefix) :]
    return name


def export_tensors(
    drafter: Eagle31Drafter, format: str, *, dtype: str = "bfloat16", include_embed: bool = False
) -> dict[str, torch.Tensor]:
    """The state dict under `format`'s names, floats cast to `dtype`, on CPU."""
    choose(ExportFormat, format, "export format")
    torch_dtype = DTYPES[choose(Dtype, dtype, "export.dtype")]
    check_vocab_maps(drafter)
    out = {}
    for name, tensor in drafter.state_dict().items():
        if name == "embed_tokens.weight":
            if not include_embed:
                continue
            if not tensor.any():
                raise ConfigError(
                    "export.include_embed=true but the drafter's embedding is all zeros (it was saved without "
                    "it); vLLM would use it instead of the target's. Export without it or load the target's first"
                )
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        out[layout_key(name, format)] = tensor.contiguous()
    return out


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


# ------------------------------------------------------------------------ config


def export_config(
    config: DrafterConfig,
    format: str,
    *,
    dtype: str = "bfloat16",
    trained_context: int | None = None,
    num_speculative_tokens: int = 3,
    target_name_or_path: str | None = None,
) -> dict[str, Any]:
    """`config.json` of `format` for a drafter with `config` (see the module docstring)."""
    choose(ExportFormat, format, "export format")
    choose(Dtype, dtype, "export.dtype")
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
    target = target_name_or_path or config.target_name_or_path
    layer = layer_fields(config, dtype, trained_context)
    eagle: dict[str, Any] = {
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
    }
    if config.target_hidden_size != config.hidden_size:
        eagle["target_hidden_size"] = config.target_hidden_size
    provenance = {
        "eagle31": {
            "format_version": EXPORT_FORMAT_VERSION,
            "target_num_layers": config.target_num_layers,
            "target_name_or_path": target,
            "target_architectures": list(config.target_architectures),
        }
    }
    if format == "eagle3":
        num_aux = {"num_aux_hidden_states": config.num_aux}
        return {"architectures": [HF_ARCHITECTURE], **layer, **num_aux, **eagle, **provenance}
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": num_speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target, "architectures": list(config.target_architectures)},
        },
        "transformer_layer_config": {**layer, "num_aux_hidden_states": config.num_aux},
        **eagle,
        **provenance,
    }


def layer_fields(config: DrafterConfig, dtype: str, trained_context: int | None) -> dict[str, Any]:
    """The decoder layer as a Llama HF config (shared by both layouts)."""
    max_positions, rope = max_positions_and_rope(config, trained_context)
    return {
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": max_positions,
        **rope_fields(rope),
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,  # transformers >= 5
        "torch_dtype": dtype,  # transformers 4 and older vLLM
    }


def max_positions_and_rope(config: DrafterConfig, trained_context: int | None) -> tuple[int, dict[str, Any]]:
    """`max_position_embeddings` raised to the trained context, with the rope kept identical."""
    rope = dict(config.rope_parameters)
    if trained_context is None:
        return config.max_position_embeddings, rope
    if isinstance(trained_context, bool) or not isinstance(trained_context, int) or trained_context < 1:
        raise ConfigError(f"trained_context must be a positive integer, got {trained_context!r}")
    if trained_context <= config.max_position_embeddings:
        return config.max_position_embeddings, rope
    if rope["rope_type"] in _ROPE_TYPES_READING_MAX_POSITIONS:
        rope.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return trained_context, rope


def rope_fields(rope: dict[str, Any]) -> dict[str, Any]:
    """The same rope as `rope_theta` + `rope_scaling` (transformers 4) and `rope_parameters` (5)."""
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return {
        "rope_theta": float(rope["rope_theta"]),
        "rope_scaling": None if scaling == {"rope_type": "default"} else scaling,
        "rope_parameters": dict(rope),
    }


# ----------------------------------------------------------------------- checks


def check_out_dir(out: Path) -> None:
    """Refuse a folder that holds weight files this export would not overwrite."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"export.out={out} exists and is not a directory")
    stale = sorted(
        p.name for p in out.iterdir() if p.suffix in (".safetensors", ".bin", ".pt") and p.name != WEIGHTS_NAME
    )
    if stale:
        raise ConfigError(f"export.out={out} already holds other weight files {stale}; vLLM would load them too")


# ------------------------------------------------------------------------- runs

RUN_CONFIG = "config.yaml"  # a run directory: <run>/config.yaml, <run>/drafter/, <run>/report.json
RUN_DRAFTER = "drafter"


def is_run_dir(path: str | Path) -> bool:
    path = Path(path)
    return (path / RUN_CONFIG).is_file() and (path / RUN_DRAFTER).is_dir()


def read_run_config(run_dir: str | Path) -> dict[str, Any]:
    """A run's `config.yaml` as a resolved plain dict."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = Path(run_dir) / RUN_CONFIG
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except (OSError, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"cannot read the run config {path}: {e}") from None


def export_options(run_config: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `export_drafter` that a run's resolved config implies."""
    export = run_config.get("export") or {}
    return {
        "dtype": export.get("dtype", "bfloat16"),
        "include_embed": bool(export.get("include_embed", False)),
        "trained_context": (run_config.get("data") or {}).get("max_len"),
        "num_speculative_tokens": (run_config.get("eval") or {}).get("num_speculative_tokens", 3),
        "target_name_or_path": (run_config.get("target") or {}).get("name"),
    }
