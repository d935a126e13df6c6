"""What vLLM reads from an EAGLE-3 drafter where it cannot run on a CPU (model construction, weight loading,
the forward), encoded from the source of the newest supported release, vLLM 0.33.0 (its wheel; read, not
copied), with the oldest one's (0.22.0) differences where they matter. What runs on a CPU (the config
pipeline, the registry, the rope tables) is run from both releases instead (`tests/export/vllm_peer.py`).

Where 0.33.0 differs from 0.22.0, and where in vLLM's source: docs/export.md, "Where the two releases differ".

Read in vllm-project/vllm 0.33.0:

* `model_executor/models/llama_eagle3.py`: `Eagle3LlamaForCausalLM`. Weight keys get
  `model.` (except `lm_head`), `midlayer.` -> `layers.0.`, q/k/v stacked into
  `qkv_proj` and gate/up into `gate_up_proj`. `d2t` becomes `draft_id_to_target_id`, which
  exists only for a reduced vocabulary (left at zeros when absent: draft id i -> target id i). `t2d`
  is skipped, and
  `embed_tokens` is optional: `v1/spec_decode/llm_base_proposer.py` gives a drafter whose
  checkpoint carries none the target's embedding module, and `LlamaModel.forward` asserts
  that the embedding is as wide as the hidden state (`drafter_embedding`). `fc` is sized
  `target_hidden_size * num_aux_hidden_states`, with `num_aux_hidden_states` falling
  back to `len(eagle_config.eagle_aux_hidden_state_layer_ids)` and then 3. Flags are
  read with `getattr(config, flag, False)`. The decoder layer with
  `norm_before_residual` takes the residual after `hidden_norm`. The final norm returns
  (normed, pre-norm) and the next step reads normed iff `norm_output`.
* `deepseek_eagle3.py`: `Eagle3DeepseekV2ForCausalLM` (also registered as
  `Eagle3DeepseekV3ForCausalLM`), the MLA drafter. The same key rules (`model.`, `d2t`,
  `t2d`, optional `embed_tokens`, `midlayer.` -> `layers.0.`), gate/up stacked, and
  `q_a_proj` + `kv_a_proj_with_mqa` stacked into `fused_qkv_a_proj` (shards 0, 1). It
  reads `num_aux_hidden_states`, `target_hidden_size`, `fc_norm`, `norm_output`,
  `norm_before_residual` as the Llama layer does, and *not* `norm_before_fc`. Its layer
  builds `DeepseekV2MLAAttention` (`deepseek_v2.py`) with input 2H and the parsed rope, whose
  `yarn` type the attention turns into `deepseek_yarn` (`deepseek_llama_scaling` for an
  `attention_factor` of 1.0).
  The attention (`layers/mla.py`): `fused_qkv_a_proj` split into [q_lora_rank,
  kv_lora_rank + qk_rope_head_dim]; q = q_b_proj(q_a_layernorm(.)), k_nope and v from
  kv_b_proj(kv_a_layernorm(.)), the rope (`DeepseekScalingRotaryEmbedding`,
  `is_neox_style=False`) on q's last qk_rope_head_dim dims and on the one shared k_pe;
  softmax scale `qk_head_dim^-0.5 * yarn_get_mscale(factor, mscale_all_dim)^2` under `deepseek_yarn`.
* The Qwen3 variant shares the Llama layer's loader rules; eagle31 does not export it.
* `transformers_utils/configs/speculators/{base,algos}.py`: the speculators layout is
  flattened into `transformer_layer_config` plus a few copied fields, with
  `norm_before_residual` defaulting to *true*; `num_speculative_tokens` is taken from
  the default proposal method.
* `transformers_utils/configs/eagle.py`: `EAGLEConfig` keeps an architecture that starts
  or ends with `Eagle3` (others get an `Eagle3` prefix) and copies every field of the
  parsed config; `model_executor/models/registry.py` maps `LlamaForCausalLMEagle3` and
  `Eagle3LlamaForCausalLM` to `llama_eagle3.Eagle3LlamaForCausalLM`.
* `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py::get_eagle3_aux_layers_from_config` (the default,
  V2 model runner): the target layers come from the top-level `eagle_aux_hidden_state_layer_ids` only
  (the V1 `v1/worker/gpu_model_runner.py` also reads `eagle_config`'s), else the target's default.
  `model_executor/models/llama.py` captures id k at the *input* of decoder layer k.
* `model_executor/models/llama.py` (`LlamaAttention`, reused by the EAGLE-3 layer): the
  rope is `get_rope(head_dim, max_position=max_position_embeddings,
  rope_parameters=config.rope_parameters, is_neox_style=True)`, with `head_dim` from the
  config or `hidden_size // num_attention_heads`. `rope_parameters` is transformers'
  parse of config.json (vLLM standardises it the way transformers 5 does). Its window: when
  `config.layer_types[layer_idx - config.target_layer_count] == "sliding_attention"` it builds its
  `Attention` with `per_layer_sliding_window=config.sliding_window` (the EAGLE-3 layer's index is the
  target's layer count, `Eagle3LlamaForCausalLM.__init__` stores that count), else None, and `Attention`
  (`layers/attention/attention.py`) falls back to `CacheConfig.sliding_window`, the target's; the
  backends attend the keys of positions P - W + 1 .. P from a query at position P
  (`v1/attention/backends/flash_attn.py`: `window_size = (W - 1, 0)`). The DeepSeek layer's
  `MultiHeadLatentAttentionWrapper` (`layers/mla.py`) builds `MLAAttention` without a window.
* `model_executor/layers/rotary_embedding/` (`get_rope` in `__init__.py`, `base.py`,
  `linear_scaling_rope.py`, `dynamic_ntk_scaling_rope.py`, `llama3_rope.py`,
  `yarn_scaling_rope.py`, `common.py`): each class precomputes a table of cos and sin per
  position, `[cos | sin]` of `position * inv_freq`, and the kernel gathers rows by
  position. `get_rope` hands YaRN only `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim`,
  `attention_factor` and `truncate`.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig

# the part of vLLM's speculative-decoding registry that loads a Llama-layer EAGLE-3 drafter
REGISTRY = {
    "LlamaForCausalLMEagle3": "Eagle3LlamaForCausalLM",
    "Eagle3LlamaForCausalLM": "Eagle3LlamaForCausalLM",
    "Eagle3DeepseekV2ForCausalLM": "Eagle3DeepseekV2ForCausalLM",
    "Eagle3DeepseekV3ForCausalLM": "Eagle3DeepseekV2ForCausalLM",
}
MLA_CLASS = "Eagle3DeepseekV2ForCausalLM"
NEWEST, OLDEST = "0.33.0", "0.22.0"
# (checkpoint shard name, vLLM fused parameter), shards of one parameter in order
STACKED = (
    (".q_proj", ".qkv_proj"),
    (".k_proj", ".qkv_proj"),
    (".v_proj", ".qkv_proj"),
    (".gate_proj", ".gate_up_proj"),
    (".up_proj", ".gate_up_proj"),
    (".q_a_proj", ".fused_qkv_a_proj"),
    (".kv_a_proj_with_mqa", ".fused_qkv_a_proj"),
)


# ----------------------------------------------------------------------- config


def hf_config_view(config_json: dict) -> dict:
    """The HF config vLLM builds the drafter from (speculators: as vLLM's `update_eagle3` flattens it)."""
    if "speculators_model_type" not in config_json:
        return dict(config_json)
    view = dict(config_json["transformer_layer_config"])
    view["draft_vocab_size"] = config_json.get("draft_vocab_size")
    if config_json.get("target_hidden_size") is not None:
        view["target_hidden_size"] = config_json["target_hidden_size"]
    view["norm_before_residual"] = config_json.get("norm_before_residual", True)
    view["norm_before_fc"] = config_json.get("norm_before_fc", False)
    view["fc_norm"] = config_json.get("fc_norm", False)
    view["norm_output"] = config_json.get("norm_output", False)
    assert view.get("model_type", "llama") in ("llama", "qwen3"), "vLLM rejects other layer model types"
    view["architectures"] = ["Eagle3LlamaForCausalLM"]
    if config_json.get("eagle_aux_hidden_state_layer_ids"):
        view["eagle_aux_hidden_state_layer_ids"] = config_json["eagle_aux_hidden_state_layer_ids"]
    return view


def model_class(view: dict) -> str | None:
    """The vLLM class the drafter's architecture resolves to under method "eagle3" (None: unknown)."""
    (arch,) = view["architectures"]
    if not (arch.startswith("Eagle3") or arch.endswith("Eagle3")):
        arch = "Eagle3" + arch
    return REGISTRY.get(arch)


def is_mla(view: dict) -> bool:
    """The drafter resolves to vLLM's DeepSeek (MLA) EAGLE-3 class."""
    return bool(view.get("architectures")) and model_class(view) == MLA_CLASS


def speculative_config(config_json: dict) -> dict:
    """vLLM's speculative config from a speculators layout (its validation included)."""
    spec = config_json["speculators_config"]
    methods = spec["proposal_methods"]
    assert isinstance(methods, list) and methods and all("proposal_type" in m for m in methods)
    assert "name_or_path" in spec["verifier"] and isinstance(config_json["transformer_layer_config"], dict)
    chosen = next((m for m in methods if m["proposal_type"] == spec.get("default_proposal_method")), methods[0])
    return {"method": config_json["speculators_model_type"], "num_speculative_tokens": chosen["speculative_tokens"]}


def effective_settings(view: dict) -> dict:
    """How `Eagle3LlamaForCausalLM` and the model runner read `view` (getattr defaults)."""
    eagle_config = view.get("eagle_config") or {}
    nested_ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    num_aux = view.get("num_aux_hidden_states")
    if num_aux is None:
        num_aux = len(nested_ids) if nested_ids else 3
    return {
        "aux_layer_ids": tuple(view.get("eagle_aux_hidden_state_layer_ids") or nested_ids or ()),
        "num_aux": num_aux,
        "target_hidden_size": view.get("target_hidden_size", view["hidden_size"]),  # getattr: null stays null
        "draft_vocab_size": view.get("draft_vocab_size") or view["vocab_size"],
        "vocab_size": view["vocab_size"],
        "fc_norm": view.get("fc_norm", False),
        "norm_output": view.get("norm_output", False),
        "norm_before_residual": view.get("norm_before_residual", False),
        # the DeepSeek layer has no input_norm: it never reads norm_before_fc
        "norm_before_fc": not is_mla(view)
        and bool(eagle_config.get("norm_before_fc", view.get("norm_before_fc", False))),
        "max_position_embeddings": view.get("max_position_embeddings", 8192),
        # LlamaAttention.__init__ (a target without a window of its own: CacheConfig's is None)
        "sliding_window": None
        if is_mla(view) or (view.get("layer_types") or [None])[0] != "sliding_attention"
        else view.get("sliding_window"),
    }


def rope_v5(view: dict) -> dict:
    """The rope transformers >= 5 (and vLLM on it) builds from `view`."""
    return dict(LlamaConfig(**{k: v for k, v in view.items() if k != "architectures"}).rope_parameters)


def deepseek_rope(view: dict, release: str = NEWEST) -> dict:
    """The rope parameters vLLM `release`'s DeepSeek attention passes to `get_rope`, its type chosen as
    `DeepseekV2MLAAttention.__init__` chooses it (0.22.0: from `rope_scaling`, as its EAGLE-3 layer rewrote it)."""
    theta = view.get("rope_theta", 10000.0)
    if release == OLDEST:
        scaling = view.get("rope_scaling")
        if not scaling:
            return {"rope_type": "default", "rope_theta": theta}
        llama_scaling = scaling.get("apply_yarn_scaling", True) is False
        rope = {**scaling, "rope_theta": theta}
    else:
        rope = rope_v5(view)
        if rope.get("rope_type", "default") == "default":
            return rope
        llama_scaling = rope.get("attention_factor") == 1.0
    return {**rope, "rope_type": "deepseek_llama_scaling" if llama_scaling else "deepseek_yarn"}


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def deepseek_rope_numbers(rope_dim: int, rope: dict, release: str = NEWEST) -> tuple[torch.Tensor, float, float]:
    """(inv_freq [rope_dim/2] float64, cos/sin magnitude, softmax-scale factor) of vLLM `release`'s DeepSeek attention
    for `get_rope`'s parameters `rope` (`DeepseekScalingRotaryEmbedding` and `DeepseekV2MLAAttention`)."""
    base = rope["rope_theta"]
    pos_freqs = torch.tensor([base ** (i / rope_dim) for i in range(0, rope_dim, 2)], dtype=torch.float64)
    if rope.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0, 1.0
    factor, orig = rope["factor"], rope["original_max_position_embeddings"]
    extrapolation = rope.get("extrapolation_factor", 1) if release == OLDEST else 1  # 0.33.0 drops it
    attn_factor = rope.get("attn_factor", 1) if release == OLDEST else 1

    def correction_dim(rotations):
        return (rope_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rope.get("beta_fast", 32))), 0)
    high = min(math.ceil(correction_dim(rope.get("beta_slow", 1))), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.tensor(
        [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(rope_dim // 2)], dtype=torch.float64
    )
    mask = (1 - ramp) * extrapolation
    inv = (1.0 / (factor * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    magnitude = yarn_get_mscale(factor, rope.get("mscale", 1)) / yarn_get_mscale(factor, rope.get("mscale_all_dim", 0))
    softmax = 1.0
    if rope["rope_type"] != "deepseek_llama_scaling":  # DeepseekV2MLAAttention: deepseek_yarn
        softmax = yarn_get_mscale(factor, float(rope.get("mscale_all_dim", False))) ** 2
    return inv, magnitude * attn_factor, softmax


def rope_v4(view: dict) -> dict:
    """The rope a transformers 4 reader sees: `rope_theta` + `rope_scaling` (`type` or `rope_type`)."""
    scaling = dict(view.get("rope_scaling") or {"rope_type": "default"})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    return {**scaling, "rope_theta": view.get("rope_theta", 10000.0)}


# ------------------------------------------------------------------ rope (vLLM)


def rope_cos_sin(view: dict, positions: torch.Tensor, release: str = NEWEST) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [len(positions), head_dim]: the rows of the table vLLM `release`'s EAGLE-3 Llama layer builds from
    `view`.

    vLLM precomputes `[cos | sin]` of `t * inv_freq` for every t of its table and gathers
    rows by position; only the asked rows are made here (a yarn table for Kimi has 262144),
    and a position past the table's end fails as vLLM's gather would. The formulas are
    those of vLLM's rotary-embedding classes; vLLM evaluates them in float32 (and stores
    the table in the model dtype), float64 here so that comparisons can be tight. Each
    row repeats over both halves of a head (neox style).
    """
    rope = rope_v5(view)
    head_size = view.get("head_dim") or view["hidden_size"] // view["num_attention_heads"]
    rotary_dim = int(head_size * rope.get("partial_rotary_factor", 1.0))
    assert rotary_dim == head_size, "a partial rope leaves head dimensions unrotated; not emulated"
    max_position = view.get("max_position_embeddings", 8192)
    base = float(rope.get("rope_theta", 10000))
    kind = rope.get("rope_type", "default")
    magnitude, t_scale = 1.0, 1.0
    if kind == "default":
        inv_freq, table_len = _plain_inv_freq(base, rotary_dim), max_position
    elif kind == "linear":  # a table factor times longer whose t is divided by factor
        t_scale, table_len = rope["factor"], int(max_position * rope["factor"])
        inv_freq = _plain_inv_freq(base, rotary_dim)
    elif kind == "dynamic":  # the base formula at the table's end: (factor - (factor - 1)) = 1, theta unchanged
        table_len = max_position * rope["factor"]
        base = base * ((table_len / max_position) - (rope["factor"] - 1)) ** (rotary_dim / (rotary_dim - 2))
        inv_freq, table_len = _plain_inv_freq(base, rotary_dim), int(table_len)
    elif kind == "llama3":
        inv_freq, table_len = _llama3_inv_freq(base, rotary_dim, rope), max_position
    elif kind == "yarn":
        inv_freq, magnitude = _yarn_inv_freq(base, rotary_dim, rope, release)
        table_len = math.ceil(rope["original_max_position_embeddings"] * rope["factor"])
    else:
        raise NotImplementedError(f"rope_type {kind!r}: not emulated")
    assert int(positions.max()) < table_len, f"position {int(positions.max())} is past vLLM's rope table ({table_len})"
    t = positions.to(torch.float64) / t_scale
    angles = t[:, None] * inv_freq[None, :]  # [P, d/2]
    cos, sin = angles.cos() * magnitude, angles.sin() * magnitude
    return torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)


def _plain_inv_freq(base: float, rotary_dim: int) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)


def _llama3_inv_freq(base: float, rotary_dim: int, rope: dict) -> torch.Tensor:
    plain = _plain_inv_freq(base, rotary_dim)
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context = rope["original_max_position_embeddings"]
    wave_len = 2 * math.pi / plain
    smooth = (old_context / wave_len - lo) / (hi - lo) if lo != hi else torch.zeros_like(plain)
    medium = (1 - smooth) * plain / factor + smooth * plain
    return torch.where(
        wave_len < old_context / hi, plain, torch.where(wave_len > old_context / lo, plain / factor, medium)
    )


def _yarn_inv_freq(base: float, rotary_dim: int, rope: dict, release: str) -> tuple[torch.Tensor, float]:
    """YaRN's blended frequencies and its magnitude (the fields `get_rope` passes on, with `release`'s defaults;
    `yarn_scaling_rope.py::YaRNScalingRotaryEmbedding.__init__`)."""
    factor, old_context = rope["factor"], rope["original_max_position_embeddings"]
    beta_fast, beta_slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)
    extrapolation = rope.get("extrapolation_factor", 1) if release == OLDEST else 1

    def correction_dim(rotations):
        return rotary_dim * math.log(old_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    hi = hi + 0.001 if lo == hi else hi
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    extrapolated_share = (1 - ramp) * extrapolation
    plain = _plain_inv_freq(base, rotary_dim)
    inv_freq = plain / factor * (1 - extrapolated_share) + plain * extrapolated_share
    if release == OLDEST:
        attn_factor = rope.get("attn_factor", 1)
        magnitude = yarn_get_mscale(factor) * attn_factor if rope.get("apply_yarn_scaling", True) else attn_factor
    elif rope.get("attention_factor") is not None:
        magnitude = rope["attention_factor"]
    elif rope.get("mscale") and rope.get("mscale_all_dim"):
        magnitude = yarn_get_mscale(factor, rope["mscale"]) / yarn_get_mscale(factor, rope["mscale_all_dim"])
    else:
        magnitude = yarn_get_mscale(factor)
    return inv_freq, float(magnitude)


# ---------------------------------------------------------------------- weights


def vllm_name(key: str) -> str | None:
    """A checkpoint key -> the vLLM parameter it loads into (None: skipped)."""
    if "t2d" in key:
        return None
    if "d2t" in key:
        return "draft_id_to_target_id"
    if "mask_hidden" in key:  # Eagle3LlamaForCausalLM.load_weights copies it into its buffer itself
        return "mask_hidden"
    name = key if "lm_head" in key else "model." + key
    name = name.replace("midlayer.", "layers.0.")
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused)
    return name


def loaded_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    """vLLM parameter -> shape of what the checkpoint fills it with (stacked shards concatenated)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, t in tensors.items():
        name = vllm_name(key)
        if name is None:
            continue
        if name in shapes:  # a second shard of a stacked parameter: rows add up
            shapes[name] = (shapes[name][0] + t.shape[0], *t.shape[1:])
        else:
            shapes[name] = tuple(t.shape)
    return shapes


def expected_params(view: dict, parallel_drafting: bool = False) -> dict[str, tuple[int, ...]]:
    """vLLM 0.33.0's parameter -> shape for the drafter it builds from `view` (embed_tokens optional), for a target
    whose vocabulary is `view`'s `vocab_size` (every eagle31 export's). `AutoWeightsLoader.load_weights` refuses a
    checkpoint tensor that maps to none of them; with `parallel_drafting` served, the model also takes (and needs)
    the `mask_hidden` buffer [1, n * Ht]."""
    s = effective_settings(view)
    H, inter = view["hidden_size"], view["intermediate_size"]
    nh, nkv = view["num_attention_heads"], view.get("num_key_value_heads", view["num_attention_heads"])
    Ht, n, Vd = s["target_hidden_size"], s["num_aux"], s["draft_vocab_size"]
    a = "model.layers.0.self_attn."
    if is_mla(view):
        qr, kvr, nope, rope, dv = (
            view[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        )
        attention = {
            a + "fused_qkv_a_proj.weight": (qr + kvr + rope, 2 * H),
            a + "q_a_layernorm.weight": (qr,),
            a + "q_b_proj.weight": (nh * (nope + rope), qr),
            a + "kv_a_layernorm.weight": (kvr,),
            a + "kv_b_proj.weight": (nh * (nope + dv), kvr),
            a + "o_proj.weight": (H, nh * dv),
        }
    else:
        d = view.get("head_dim") or H // nh
        attention = {a + "qkv_proj.weight": ((nh + 2 * nkv) * d, 2 * H), a + "o_proj.weight": (H, nh * d)}
    p = {
        "model.embed_tokens.weight": (view["vocab_size"], H),
        "model.fc.weight": (H, Ht * n),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.hidden_norm.weight": (H,),
        "model.layers.0.post_attention_layernorm.weight": (H,),
        **attention,
        "model.layers.0.mlp.gate_up_proj.weight": (2 * inter, H),
        "model.layers.0.mlp.down_proj.weight": (H, inter),
        "model.norm.weight": (H,),
        "lm_head.weight": (Vd, H),
    }
    if Vd != view["vocab_size"]:  # Eagle3*ForCausalLM.__init__: only for a reduced vocabulary
        p["draft_id_to_target_id"] = (Vd,)
    if s["fc_norm"]:
        p.update({f"model.fc_norm.{i}.weight": (Ht,) for i in range(n)})
    if s["norm_before_fc"]:
        p["model.input_norm.weight"] = (Ht * n,)
    if parallel_drafting:
        p["mask_hidden"] = (1, Ht * n)
    return p


# -------------------------------------------------------------- numerics (vLLM)


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _vllm_params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors under vLLM's names; stacked shards placed by shard id (q, k, v / gate, up)."""
    order = {shard: i for i, (shard, _) in enumerate(STACKED)}
    shards: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, t in tensors.items():
        name = vllm_name(key)
        if name is not None:
            rank = next((order[s] for s in order if s in key), 0)
            shards.setdefault(name, []).append((rank, t))
    return {name: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for name, parts in shards.items()}


def drafter_embedding(config_json: dict, tensors: dict[str, torch.Tensor], target_embed: torch.Tensor) -> torch.Tensor:
    """The embedding vLLM's drafter runs with: its own when the checkpoint carries one, else the target's.

    vLLM keeps the drafter's own (or, when equal, the target's: the same values); it shares the
    target's [V, Ht] when the checkpoint has none, and then its forward asserts that the
    embedding's width equals the drafter's hidden size.
    """
    view = hf_config_view(config_json)
    own = next((t for k, t in tensors.items() if k.endswith("embed_tokens.weight")), None)
    embed = own if own is not None else target_embed
    if embed.shape[-1] != view["hidden_size"]:
        raise AssertionError(
            f"vLLM's drafter forward asserts hidden_states.shape[-1] == input_embeds.shape[-1]: "
            f"{view['hidden_size']} != {embed.shape[-1]} (the target's embedding was shared)"
        )
    return embed


def chain_logits(
    config_json: dict,
    tensors: dict[str, torch.Tensor],
    embed: torch.Tensor,
    aux: torch.Tensor,
    input_ids: torch.Tensor,
    steps: int,
    release: str = NEWEST,
) -> list[torch.Tensor]:
    """Per draft step, logits over the *target* vocabulary [T, V] as vLLM `release` computes them.

    One sequence: aux [T, n*Ht], input_ids [T]. Query (p, j) reads token x[p+1+j] at
    position p+j and attends to the step-0 keys of 0..p plus its own chain, exactly as
    the proposer's KV cache holds them (tokens teacher-forced instead of sampled); a sliding window W keeps
    the keys of positions p + j - W + 1 .. p + j.
    """
    view = hf_config_view(config_json)
    s = effective_settings(view)
    W = {k: v.double() if v.is_floating_point() else v for k, v in _vllm_params(tensors).items()}
    eps = view["rms_norm_eps"]
    T, Vd, V = input_ids.shape[0], s["draft_vocab_size"], s["vocab_size"]
    L = "model.layers.0."
    attention_inputs = _mla_qkv if is_mla(view) else _llama_qkv

    # combine_hidden_states
    h = aux.double()
    if s["norm_before_fc"]:
        h = _rms(h, W["model.input_norm.weight"], eps)
    if s["fc_norm"] and not (is_mla(view) and release == OLDEST):  # 0.22.0's DeepSeek class never applies it
        h = torch.cat(
            [_rms(c, W[f"model.fc_norm.{i}.weight"], eps) for i, c in enumerate(h.chunk(s["num_aux"], -1))], -1
        )
    hidden = h @ W["model.fc.weight"].T  # [T, H]

    targets = torch.arange(Vd) + W.get("draft_id_to_target_id", torch.zeros(Vd, dtype=torch.long))
    keys0 = values0 = None
    chain_k, chain_v = [], []
    out = []
    for j in range(steps):
        tok = torch.cat([input_ids[1 + j :], input_ids.new_zeros(min(1 + j, T))])[:T]
        pos = torch.arange(T) + j
        emb = _rms(embed[tok].double(), W[L + "input_layernorm.weight"], eps)
        if s["norm_before_residual"]:
            hidden = _rms(hidden, W[L + "hidden_norm.weight"], eps)
            residual = hidden
        else:
            residual = hidden
            hidden = _rms(hidden, W[L + "hidden_norm.weight"], eps)
        q, k, v, scale = attention_inputs(view, W, torch.cat([emb, hidden], -1), pos, release)
        if j == 0:
            keys0, values0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        attn = _attend(
            q, keys0, values0, chain_k, chain_v, q.shape[1] // k.shape[1], scale, s["sliding_window"]
        )  # [T, nh*dv]
        x = attn @ W[L + "self_attn.o_proj.weight"].T
        residual = x + residual  # post_attention_layernorm(x, residual): fused add
        x = _rms(residual, W[L + "post_attention_layernorm.weight"], eps)
        gate, up = (x @ W[L + "mlp.gate_up_proj.weight"].T).chunk(2, -1)
        x = (torch.nn.functional.silu(gate) * up) @ W[L + "mlp.down_proj.weight"].T
        prenorm = x + residual  # model.norm(x, residual): fused add
        normed = _rms(prenorm, W["model.norm.weight"], eps)
        logits = torch.full((T, V), float("-inf"), dtype=torch.float64)
        logits[:, targets] = normed @ W["lm_head.weight"].T
        out.append(logits)
        hidden = normed if s["norm_output"] else prenorm
    return out


def _llama_qkv(view, W, z, pos, release):
    """`Eagle3LlamaForCausalLM`'s attention inputs: z [T, 2H] -> q [T, nh, d], k, v [T, nkv, d], scale."""
    T, H = z.shape[0], view["hidden_size"]
    nh, nkv = view["num_attention_heads"], view["num_key_value_heads"]
    d = view.get("head_dim") or H // nh
    q, k, v = (z @ W["model.layers.0.self_attn.qkv_proj.weight"].T).split([nh * d, nkv * d, nkv * d], -1)
    cos, sin = rope_cos_sin(view, pos, release)
    return _rope(q.view(T, nh, d), cos, sin), _rope(k.view(T, nkv, d), cos, sin), v.view(T, nkv, d), d**-0.5


def _mla_qkv(view, W, z, pos, release):
    """`DeepseekV2MLAAttention`'s inputs to attention: z [T, 2H] -> q, k [T, nh, nope+rope], v [T, nh, v], scale."""
    a, eps, T, nh = "model.layers.0.self_attn.", view["rms_norm_eps"], z.shape[0], view["num_attention_heads"]
    qr, kvr, nope, rope, dv = (
        view[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    )
    q_c, kv_lora = (z @ W[a + "fused_qkv_a_proj.weight"].T).split([qr, kvr + rope], -1)
    q = (_rms(q_c, W[a + "q_a_layernorm.weight"], eps) @ W[a + "q_b_proj.weight"].T).view(T, nh, nope + rope)
    kv_c, k_pe = kv_lora.split([kvr, rope], -1)
    kv = (_rms(kv_c, W[a + "kv_a_layernorm.weight"], eps) @ W[a + "kv_b_proj.weight"].T).view(T, nh, nope + dv)
    inv, magnitude, softmax = deepseek_rope_numbers(rope, deepseek_rope(view, release), release)
    angles = pos[:, None].double() * inv  # [T, rope/2]
    cos, sin = (angles.cos() * magnitude).repeat_interleave(2, -1), (angles.sin() * magnitude).repeat_interleave(2, -1)
    q = torch.cat([q[..., :nope], _rope_gptj(q[..., nope:], cos, sin)], -1)
    k_pe = _rope_gptj(k_pe[:, None], cos, sin).expand(T, nh, rope)
    return q, torch.cat([kv[..., :nope], k_pe], -1), kv[..., nope:], (nope + rope) ** -0.5 * softmax


def _rope(x, cos, sin):
    """x [T, heads, d]; cos/sin [T, d] (rotate-half, as vLLM's neox-style rope)."""
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def _rope_gptj(x, cos, sin):
    """x [T, heads, d]; cos/sin [T, d] with each frequency on a pair (vLLM's `rotate_gptj`, is_neox_style=False)."""
    rotated = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    return x * cos[:, None] + rotated * sin[:, None]


def _attend(q, k0, v0, chain_k, chain_v, groups, scale, window=None):
    """Query p: causal step-0 keys 0..p plus its own chain keys (p, 1..j); with a window W the keys of the
    cache slots (= positions) p + j - W + 1 .. p + j, flash attention's `window_size = (W - 1, 0)`."""
    T, j = q.shape[0], len(chain_k)
    k0, v0 = k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1)
    scores = torch.einsum("thd,shd->hts", q, k0) * scale  # [nh, T, T]
    back = torch.arange(T)[:, None] + j - torch.arange(T)[None]  # query position p + j minus key position p'
    seen = (back >= j) & (back <= (window or T + j) - 1)
    scores = scores.masked_fill(~seen, float("-inf"))
    assert window is None or window > j, "the chain keys (p, 1..j) are inside the window"
    own = [torch.einsum("thd,thd->ht", q, ck.repeat_interleave(groups, 1)) * scale for ck in chain_k]
    scores = torch.cat([scores, *(o[..., None] for o in own)], -1)
    probs = scores.softmax(-1)
    out = torch.einsum("hts,shd->thd", probs[..., :T], v0)
    for i, cv in enumerate(chain_v):
        out = out + probs[..., T + i].T[..., None] * cv.repeat_interleave(groups, 1)
    return out.reshape(T, -1)
