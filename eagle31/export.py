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
  `transformer_layer_config`, the only block vLLM copies whole, with `fc_norm` and
  `norm_output`: vLLM 0.22's speculators reader (`configs/speculators/algos.py::update_eagle3`)
  copies neither from the top level, so a 3.1 drafter would be served as EAGLE 3.
* `d2t` and `t2d` are written for a reduced vocabulary (`Vd < V`) only; `d2t` is checked
  against `t2d` (without it vLLM maps draft id i to target id i and acceptance collapses).
  With the full vocabulary vLLM >= 0.33 builds no `draft_id_to_target_id` and refuses a
  checkpoint that carries one (`llama_eagle3.py`, `deepseek_eagle3.py`); older releases
  leave it at zeros, the identity, so leaving both out is right for every release.
* `target_hidden_size` is written only when it differs from `hidden_size`: vLLM reads
  `getattr(config, "target_hidden_size", hidden_size)`, so a `null` breaks it.
* `max_position_embeddings` is at least the trained context. A lower value is raised
  to it rather than failing at the end of a run. Rope types whose frequencies depend on
  it (llama3, yarn, dynamic, longrope) then get the old value pinned as
  `original_max_position_embeddings`, so the rope is unchanged.
* The rope is the one the drafter trained with only when every supported vLLM release
  reads it so (`eagle31.rope`): a block that two releases read as different ropes
  (DeepSeek's yarn `mscale` fields in a Llama layer, `attn_factor`, an MLA block with
  `attention_factor: 1.0`, say) is refused, naming the fields and the releases.
* The rope is written in both forms: `rope_theta` + `rope_scaling` (transformers 4
  readers) and `rope_parameters` (transformers 5). They always agree, because
  transformers 5 lets `rope_scaling` win when both are present.
* A sliding window (`drafter.sliding_window = W`) is written as vLLM reads a draft layer's window:
  `sliding_window: W` with `layer_types: ["sliding_attention"]`, in the layer's fields (so inside
  `transformer_layer_config` in the speculators layout). vLLM 0.22 to 0.33 take a layer's window only
  from there (`model_executor/models/llama.py::LlamaAttention.__init__`: `layer_types[layer_idx -
  target_layer_count]`, the count `llama_eagle3.py::Eagle3LlamaForCausalLM.__init__` stores); a top-level
  `sliding_window` alone is not read for a drafter (the model-wide window of `CacheConfig` is the
  target's). Every attention backend then attends keys `P - W + 1 .. P` from a query at position P (flash
  attention's `window_size = (W - 1, 0)`), the window the drafter trained with. vLLM's DeepSeek EAGLE-3
  layer builds its MLA attention without a window in both releases, so an MLA drafter with a window is
  refused: it would be served with full attention. A full-attention drafter writes neither field.
* Safetensors metadata `{"format": "pt"}` is set, because transformers-based readers
  (the `speculators` library) refuse files without it.
* The embedding (`embed_tokens.weight`) is written by default in the speculators layout:
  speculators' `from_pretrained` (0.9.0) leaves a missing one as uninitialised memory. The
  HF layout omits it by default (vLLM shares the target's), except for a drafter whose
  `hidden_size` differs from the target's: vLLM would hand it the target's wider
  embedding, so its own is always written and an export without it is refused.
* The speculators layout must name its target (`speculators_config.verifier.name_or_path`):
  speculators' `from_pretrained` reads the target's config from it and fails on `null`.
  A local path there is written (speculators reads it) with a warning: `vllm serve
  <export>` in vLLM 0.33 accepts only a Hub id (`maybe_override_with_speculators`).
* The output folder is replaced whole (`eagle31.io.atomic_dir`), so no file of an earlier
  export survives (vLLM loads every `*.safetensors` it finds). Only an empty folder or an
  earlier export of ours (its marker file) is written to; replacing an export needs
  `overwrite=True`, and a folder that also holds files eagle31 did not write, or that is
  (or holds) the drafter being exported, is refused.

MLA drafters (`attention="mla"`, `eagle31.mla`) have one layout: the EAGLE-3 HF layout
as vLLM's DeepSeek EAGLE-3 loader (`deepseek_eagle3.py`) reads it, with
`architectures: ["Eagle3DeepseekV2ForCausalLM"]`, `model_type: "kimi_k2"` (as TorchSpec and the
published Kimi drafters write it), the MLA shape (`q_lora_rank`,
`kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`) and the rope as
`rope_theta` + `rope_scaling`, which vLLM turns into DeepSeek YaRN. Weights keep DeepSeek's
names (`midlayer.self_attn.q_a_proj`, `kv_a_proj_with_mqa`, ...); vLLM fuses `q_a_proj`
with `kv_a_proj_with_mqa` at load. The model type is `kimi_k2` for every MLA drafter, a Kimi or
a DeepSeek-V3 target alike: vLLM maps it to `DeepseekV3Config` (its
`transformers_utils/config.py` registry), and its `SpeculativeConfig.hf_config_override`
leaves it alone, whereas it turns `deepseek_v3` into DeepSeek's MTP drafter
(`DeepSeekMTPModel`, whose EAGLE-3 name no registry has), in 0.22 and 0.33 alike. The
speculators layout cannot carry an MLA drafter
(its `transformer_layer_config` is a Llama or Qwen3 layer, the only ones vLLM's speculators
reader and the `speculators` library map) and is refused.

Both layouts also carry an `eagle31` block (format version, target layer count, name,
architectures) that `eagle31.convert.load_drafter` uses to read them back exactly.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle31.config import MLA_FIELDS, ConfigError, DrafterConfig
from eagle31.io import OUTPUT_MARKER, ForeignDirectoryError, atomic_dir, atomic_save_safetensors, atomic_write_json, check_output_dir
from eagle31.model import Eagle31Drafter
from eagle31.recipe import Dtype, ExportFormat, choose
from eagle31.rope import ambiguity as rope_ambiguity

DTYPES = {d: getattr(torch, d) for d in Dtype}
HF_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
MLA_MODEL_TYPE = "kimi_k2"  # module docstring: vLLM rewrites deepseek_v3 to its MTP drafter
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
EXPORT_FORMAT_VERSION = 1
WEIGHTS_NAME = "model.safetensors"
EXPORT_KIND = "export"  # the kind in an export folder's marker (eagle31.io.OUTPUT_MARKER)
# what an export folder may hold: the export itself and the model card scripts/push_to_hub.py adds
EXPORT_FILES = ("config.json", WEIGHTS_NAME, "README.md", OUTPUT_MARKER)
# the decoder layer's key prefix per layout; everything else keeps eagle31's (= HF) names
LAYER_PREFIX = {"eagle3": "midlayer.", "speculators": "layers.0."}
# the vocabulary maps, written only for a reduced vocabulary (module docstring)
VOCAB_MAPS = ("d2t", "t2d")
# rope types whose frequencies read max_position_embeddings when original_max_position_embeddings is absent
_ROPE_TYPES_READING_MAX_POSITIONS = ("llama3", "yarn", "dynamic", "longrope")


def export_drafter(
    drafter: Eagle31Drafter,
    out_dir: str | Path,
    format: str = "eagle3",
    *,
    dtype: str = "bfloat16",
    include_embed: bool | None = None,
    trained_context: int | None = None,
    num_speculative_tokens: int = 3,
    target_name_or_path: str | None = None,
    overwrite: bool = False,
    source: str | Path | None = None,
) -> Path:
    """Write `drafter` to `out_dir` in `format` ("eagle3" | "speculators"); returns `out_dir`.

    dtype: "bfloat16" | "float16" | "float32" for the floating-point weights (d2t stays
    int64, t2d bool; both only for Vd < V). include_embed: also write the (frozen, target's) embedding; None
    means the layout's default (module docstring). trained_context: the longest training
    sequence (`data.max_len`). num_speculative_tokens: the k written in the speculators
    layout. target_name_or_path: the target's Hub id or path (default: the drafter
    config's). overwrite: replace an earlier export in `out_dir`. source: the directory
    the drafter was read from, which `out_dir` must not be or contain.
    """
    out = Path(out_dir)
    check_export_out(out, overwrite=overwrite, source=source)
    config = export_config(
        drafter.config,
        format,
        dtype=dtype,
        trained_context=trained_context,
        num_speculative_tokens=num_speculative_tokens,
        target_name_or_path=target_name_or_path,
    )
    tensors = export_tensors(drafter, format, dtype=dtype, include_embed=include_embed)
    with atomic_dir(out, EXPORT_KIND) as tmp:
        atomic_save_safetensors(tensors, tmp / WEIGHTS_NAME, save_file, metadata={"format": "pt"})
        atomic_write_json(tmp / "config.json", config)
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
    drafter: Eagle31Drafter, format: str, *, dtype: str = "bfloat16", include_embed: bool | None = None
) -> dict[str, torch.Tensor]:
    """The state dict under `format`'s names, floats cast to `dtype`, on CPU."""
    choose(ExportFormat, format, "export format")
    torch_dtype = DTYPES[choose(Dtype, dtype, "export.dtype")]
    check_vocab_maps(drafter)
    with_embed = embed_included(drafter.config, format, include_embed)
    full_vocab = drafter.config.draft_vocab_size == drafter.config.vocab_size
    out = {}
    for name, tensor in drafter.state_dict().items():
        if full_vocab and name in VOCAB_MAPS:
            continue
        if name == "embed_tokens.weight":
            if not with_embed:
                continue
            if not tensor.any():
                raise ConfigError(_missing_embed_message(drafter.config, format, include_embed))
        tensor = tensor.detach().cpu()
        if tensor.is_floating_point():
            tensor = tensor.to(torch_dtype)
        out[layout_key(name, format)] = tensor.contiguous()
    return out


def embed_included(config: DrafterConfig, format: str, include_embed: bool | None) -> bool:
    """Whether the export carries `embed_tokens.weight` (module docstring: the layout's default)."""
    own = config.target_hidden_size != config.hidden_size
    if include_embed is None:
        return own or format == "speculators"
    if own and not include_embed:
        raise ConfigError(
            f"include_embed=false, but the drafter's hidden_size={config.hidden_size} differs from "
            f"target_hidden_size={config.target_hidden_size}: vLLM would give it the target's embedding, "
            "which is the wrong width. Export it with its own (include_embed=true)"
        )
    return include_embed


def _missing_embed_message(config: DrafterConfig, format: str, include_embed: bool | None) -> str:
    problem = "the drafter's embedding is all zeros (its checkpoint carries none)"
    if config.target_hidden_size != config.hidden_size:
        return (f"{problem}, and a drafter whose hidden_size={config.hidden_size} differs from its target's "
                f"({config.target_hidden_size}) cannot share the target's: load its own embedding first")
    if include_embed is None:  # the speculators default
        return (f"{problem}; the speculators layout carries it by default because speculators' from_pretrained "
                "leaves a missing one uninitialised. Load the target's embedding into the drafter first, or pass "
                "include_embed=false (vLLM then shares the target's)")
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
    if config.attention == "mla" and format != "eagle3":
        raise ConfigError(
            f"export format {str(format)!r} cannot carry an MLA drafter (drafter.attention=mla): the speculators layout "
            "maps only Llama/Qwen3 layers; export it as 'eagle3' (vLLM's Eagle3DeepseekV2ForCausalLM)"
        )
    if config.attention == "mla" and config.sliding_window is not None:
        raise ConfigError(
            f"drafter.sliding_window={config.sliding_window} cannot be served: vLLM's DeepSeek EAGLE-3 layer "
            "(Eagle3DeepseekV2ForCausalLM, 0.22 to 0.33) builds its MLA attention without a window and would attend "
            "every key. Train the MLA drafter with sliding_window=null, or a Llama-attention drafter with the window"
        )
    k = num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"num_speculative_tokens must be a positive integer, got {num_speculative_tokens!r}")
    target = target_name_or_path or config.target_name_or_path
    check_rope_reading(config)
    if format == "speculators" and not target:
        raise ConfigError(
            "the speculators layout must name its target (speculators_config.verifier.name_or_path; speculators' "
            "from_pretrained fails on null) and the drafter's config names none: pass the target's Hub id or path "
            "(scripts/export.py target=...)"
        )
    if format == "speculators" and (Path(target).exists() or target.startswith(("/", ".", "~"))):
        warnings.warn(
            f"speculators_config.verifier.name_or_path={target} is a local path, which `vllm serve <export>` (vLLM 0.33) "
            f"refuses: serve it as `vllm serve {target} --speculative-config '{{\"method\": \"eagle3\", \"model\": "
            "<export>}'`, or give target.name the target's Hub id"
        )
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
        architecture = MLA_ARCHITECTURE if config.attention == "mla" else HF_ARCHITECTURE
        return {"architectures": [architecture], **layer, **num_aux, **eagle, **provenance}
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
        # the 3.1 flags also in the block vLLM copies whole: 0.22's speculators reader copies no other
        "transformer_layer_config": {**layer, "num_aux_hidden_states": config.num_aux,
                                     "fc_norm": config.fc_norm, "norm_output": config.norm_output},
        **eagle,
        **provenance,
    }


def layer_fields(config: DrafterConfig, dtype: str, trained_context: int | None) -> dict[str, Any]:
    """The decoder layer as a Llama HF config (shared by both layouts), or a DeepSeek-V3 one (MLA)."""
    max_positions, rope = max_positions_and_rope(config, trained_context)
    if config.attention == "mla":
        attention = {"model_type": MLA_MODEL_TYPE, **{name: getattr(config, name) for name in MLA_FIELDS}}
    else:
        attention = {"model_type": "llama", "head_dim": config.head_dim}
    return {
        **attention,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": max_positions,
        **rope_fields(rope),
        **sliding_window_fields(config),
        "vocab_size": config.vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": dtype,  # transformers >= 5
        "torch_dtype": dtype,  # transformers 4 and older vLLM
    }


def sliding_window_fields(config: DrafterConfig) -> dict[str, Any]:
    """The layer's window as vLLM's Llama attention reads it (module docstring); nothing for full attention."""
    if config.sliding_window is None:
        return {}
    return {"sliding_window": config.sliding_window, "layer_types": ["sliding_attention"]}


def served_sliding_window(layer: dict[str, Any]) -> int | None:
    """The window vLLM serves a Llama drafter layer (`layer`: its config.json fields) with: `sliding_window`
    when its one layer type is `sliding_attention`, otherwise none."""
    if (layer.get("layer_types") or [None])[0] != "sliding_attention":
        return None
    return layer.get("sliding_window")


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


def check_rope_reading(config: DrafterConfig) -> None:
    """Refuse a rope block that the supported vLLM releases read as different ropes (`eagle31.rope.ambiguity`): the
    served rope would depend on the release."""
    reason = rope_ambiguity(config.rope_parameters, config.attention)
    if reason:
        raise ConfigError(
            f"drafter.rope_parameters is read two ways: {reason}; the served rope would depend on the vLLM release. "
            "Fine-tune it with drafter.init_from (the drafter then takes a rope read one way) and export that"
        )


def check_export_out(out: Path, *, overwrite: bool = False, source: str | Path | None = None) -> None:
    """Refuse an output folder that is not ours to replace (module docstring), before any work."""
    if source is not None:
        src, dest = Path(source).resolve(), out.resolve()
        if dest == src or dest in src.parents:
            raise ConfigError(
                f"out={out} is or holds the drafter being exported ({source}); the export would replace it. "
                "Choose another directory"
            )
    try:
        check_output_dir(out, EXPORT_KIND)
    except ForeignDirectoryError as e:
        raise ConfigError(f"out: {e}") from None
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise ConfigError(f"out={out} already holds an eagle31 export; pass overwrite=true to replace it")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES and ".tmp-" not in p.name)
    if foreign:
        raise ConfigError(
            f"out={out} holds files eagle31 did not write {foreign}; overwrite=true replaces the whole folder, "
            "so move them elsewhere first"
        )


# ------------------------------------------------------------------------- runs

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
